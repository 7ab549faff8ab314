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
mod start;

pub use crate::cluster::capacity::{DEFAULT_MAX_PODS, Reservation, Reserved, measure};
use crate::server::plain as http;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kubelet_api::constants::{DEVICE_PLUGINS_DIR, PLUGINS_REGISTRY_DIR};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cluster::{Cluster, ClusterSettings};
use crate::csi::{CsiDriverRegistry, CsiHandlerConfig, CsiNodeTimeouts, InMemoryNodeInfo};
use crate::device_manager::{DeviceManager, DeviceManagerConfig, DeviceManagerError};
use crate::health::{HealthReporter, Healthz};
use crate::plugin_manager::{PluginHandler, PluginManagerConfig, PluginManagerError, PluginManagerHandle, PluginType};
use crate::pod::{Allocatable, BackoffConfig, Pods};
use crate::provider::Provider;
use crate::static_pods::StaticPods;
use crate::volume::{CsiDriverObjects, VolumeClaims};

/// Streaming sessions served at once by default.
pub const DEFAULT_MAX_STREAMING_SESSIONS: usize = 1024;

/// The file in the root dir that names the running node's health port.
pub(crate) const ENDPOINT_FILE: &str = "rustlet-endpoint";

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
    /// What the machine has; `None` measures it ([`measure`]).
    pub allocatable: Option<Allocatable>,
    /// What is held back from pods of it (`--system-reserved`,
    /// `--kube-reserved`, the hard eviction thresholds): allocatable is
    /// what is left.
    pub reservation: Reservation,
    /// The eviction manager's settings; `None`: no eviction manager (the
    /// node reports no pressure).
    pub eviction: Option<crate::eviction::manager::EvictionSettings>,
    /// The node's pressure, shared by the eviction manager, admission and
    /// the Node's conditions.
    pub pressure: crate::eviction::pressure::Pressure,
    /// Container log rotation (upstream's 10Mi, 5 files, checked every
    /// 10 s); `None`: logs are never rotated.
    pub log_rotation: Option<crate::log_rotation::LogRotation>,
    /// Garbage collection of exited containers and unused images
    /// (upstream's periods and policy); `None`: none.
    pub gc: Option<crate::gc::GcSettings>,
    /// Container restart backoff (upstream: 10 s doubling to 5 min).
    pub restart_backoff: BackoffConfig,
    /// Image pull backoff.
    pub image_backoff: BackoffConfig,
    /// The backoff of a pod whose volumes cannot be prepared yet
    /// ([`BackoffConfig::VOLUMES`]).
    pub volume_backoff: BackoffConfig,
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
    /// How often the pods' claim volumes are measured
    /// (`--volume-stats-agg-period`; upstream: a minute).
    pub volume_stats_period: Duration,
    /// Where the node reads CDI specs for a provider that does not
    /// (`--cdi-spec-dir`; upstream's `/etc/cdi`, `/var/run/cdi`).
    pub cdi_spec_dirs: Vec<PathBuf>,
}

impl Default for PodSettings {
    fn default() -> Self {
        PodSettings {
            manifest_dir: None,
            manifest_rescan: Duration::from_secs(20),
            max_pods: DEFAULT_MAX_PODS,
            allocatable: None,
            reservation: Reservation::default(),
            eviction: None,
            pressure: crate::eviction::pressure::Pressure::default(),
            log_rotation: Some(crate::log_rotation::LogRotation::default()),
            gc: Some(crate::gc::GcSettings::default()),
            restart_backoff: BackoffConfig::default(),
            image_backoff: BackoffConfig::default(),
            volume_backoff: BackoffConfig::VOLUMES,
            csi_timeouts: CsiNodeTimeouts::default(),
            cluster_domain: String::new(),
            allowed_unsafe_sysctls: Vec::new(),
            volume_refresh: Duration::from_secs(60),
            volume_stats_period: crate::volume::stats::DEFAULT_PERIOD,
            cdi_spec_dirs: kubelet_pods::pod::cdi::DEFAULT_SPEC_DIRS.iter().map(PathBuf::from).collect(),
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
        let NodeBuilder { mut config, handlers, mut metrics, healthz, provider, claims, cluster } = self;
        // The serving certificate's series sit beside the client's.
        if let (Some(cluster), Some(api)) = (&cluster, config.kubelet_api.as_mut()) {
            api.metrics = cluster.metrics.clone();
        }
        let created = jiff::Timestamp::now();
        let tasks = TaskTracker::new();
        let supervision = start::supervision(&mut metrics, &healthz, &tasks, &shutdown);
        let wiring = start::Wiring {
            config: &config,
            healthz: &healthz,
            tasks: &tasks,
            supervision: &supervision,
            shutdown: &shutdown,
        };
        start::share_root_dir(&config.root_dir);
        let in_cluster = cluster.is_some();
        let plugins = start::start_plugins(&wiring, handlers, in_cluster, &mut metrics)?;
        let capacity = node_capacity(&config, provider.as_deref());
        let allocatable = config.pods.reservation.allocatable(capacity);
        // Every runtime call is counted and timed (`kubelet_runtime_operations_*`).
        let pod_metrics = kubelet_pods::metrics::PodMetrics::default();
        let provider = provider.map(|p| kubelet_pods::metrics::MeteredProvider::wrap(p, pod_metrics.clone()));
        let (lifecycle, parts) =
            start::pod_lifecycle(&config, allocatable, provider.clone(), claims, in_cluster, &plugins);
        let lifecycle = lifecycle.with_metrics(pod_metrics);
        let (pods, static_pods) =
            start::start_pods(&wiring, lifecycle, &parts, &plugins, cluster.as_ref(), &mut metrics).await?;
        start::start_eviction(&wiring, &pods, provider.clone(), &parts.event_recorder);
        start::start_log_rotation(&wiring, &pods, provider.clone());
        start::start_gc(&wiring, provider.clone(), &parts.event_recorder);
        start::start_relist(&wiring, &pods, provider.clone());
        // The Node's description flows down from here: to the HTTP
        // surfaces and to cluster mode, which only read it.
        let kubelet_api = start::bind_kubelet_api(&wiring, &plugins, &parts).await?;
        let kubelet_port = kubelet_api.as_ref().map(|api| api.address.port());
        let described = start::Described { created, capacity, allocatable, provider: provider.clone() };
        let description = start::describe(&config, described, kubelet_port);
        let endpoints = start::start_endpoints(
            &wiring,
            kubelet_api,
            description.clone(),
            provider,
            &plugins,
            &pods,
            static_pods.clone(),
            metrics,
        )
        .await?;
        let (dra_claims, csi_objects) = (parts.dra_claims.clone(), parts.csi_objects.clone());
        let cluster = start::start_cluster(&wiring, cluster, description, parts, &plugins, &pods);
        tracing::info!(node = %config.node_name, root_dir = %config.root_dir.display(), ?allocatable, cluster = cluster.is_some(), "node started");
        let start::PluginParts { csi_drivers, node_info, devices, dra_drivers, plugins, .. } = plugins;
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
            http_address: endpoints.http,
            kubelet_api_address: endpoints.kubelet_api,
            tasks,
            pods,
            static_pods,
            allocatable,
            cluster,
        })
    }
}

/// Capacity from the settings (or measured from the machine), its pods
/// lowered to what the provider's process can hold.
fn node_capacity(config: &NodeConfig, provider: Option<&dyn Provider>) -> Allocatable {
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
    let written = crate::durable::write(&path, format!("http://{address}\n").as_bytes(), 0o644);
    if let Err(error) = written {
        tracing::warn!(%error, path = %path.display(), "cannot write the endpoint file; `rustlet get` will not find this node");
    }
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
