//! Cluster mode: the node in a Kubernetes cluster, through kube-rs.
//!
//! The facade's `NodeBuilder::cluster` turns it on. Once the API client
//! is ready (from a client the embedder gives, or read from a kubeconfig,
//! retried with backoff while the file is missing or invalid), these run
//! beside the standalone parts, which never wait on the API:
//!
//! - `node_sync`: the Node object (created or adopted, created again after
//!   an administrator deletes it), its status (capacity and allocatable
//!   with every device-plugin resource, conditions, addresses, node info;
//!   patched on change, coalesced) and its Lease.
//! - `pod_sync`: pods bound to the node run through the lifecycle; their
//!   statuses are patched; their deletion is finished with grace period 0
//!   and a UID precondition.
//!   Static pods get mirror pods.
//! - `csi_info`: CSI drivers' node IDs, topology labels and the CSINode.
//! - `volumes`: CSIDriver objects (watched), `persistentVolumeClaim`
//!   volumes resolved through the API (claim → PV → CSI, with secrets), and
//!   the ConfigMaps, Secrets and service-account tokens of configMap,
//!   secret and projected volumes and env references.
//!
//! - events the pod lifecycle records, written as core/v1 Events.
//! - [`pki`] and [`certificates`]: keys and certificates, TLS bootstrap
//!   and rotation of the client and serving certificates.
//!
//! Image pull secrets are read through the same client and handed to the
//! provider.
mod api_events;
pub mod api_metrics;
pub mod capacity;
pub mod certificates;
pub mod claims;
pub mod csi_info;
mod mirror;
pub mod node_sync;
mod object_watch;
pub mod pki;
pub mod pod_sync;
pub mod rate_limit;
mod read_cache;
pub mod runtime_classes;
mod service_watch;
pub mod status_patch;
pub mod volumes;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Taint};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use csi_info::{ApiNodeInfo, CsiInfoStats};
pub use kubelet_support::supervisor::Supervision;
pub use node_sync::{LEASE_NAMESPACE, NodeSync, NodeSyncConfig, NodeSyncStats};
pub use pod_sync::{PodSync, PodSyncConfig, PodSyncMetrics, PodSyncStats};

use kubelet_api::uds::error_chain;
use kubelet_plugins::{csi, device_manager, dra};
use kubelet_pods::{events, eviction, pod, runtime_class, volume};
use kubelet_provider as provider;
use kubelet_support::{durable, health, retry};

use capacity::NodeDescription;
use device_manager::DeviceManager;
use health::Healthz;
use pod::Pods;
use volume::CsiDriverObjects;

/// The Kubernetes releases whose node conformance suites Rustlet passes,
/// oldest first. The Node reports the newest of them the control plane is
/// not older than ([`kubelet_version_for`]).
pub(crate) const CONFORMS_TO: [&str; 2] = ["v1.28.7", "v1.33.3"];

/// The newest Kubernetes release Rustlet conforms to.
pub const KUBERNETES_VERSION: &str = "v1.33.3";

/// Rustlet's version where no control plane says otherwise (standalone,
/// or before `/version` answers): the newest release it conforms to, with
/// Rustlet's own version as semver build metadata, so that version skew
/// checks (kubeadm's, the API server's) read a Kubernetes version.
pub const VERSION: &str = concat!("v1.33.3+rustlet.", env!("CARGO_PKG_VERSION"));

/// What `rustlet --version` prints: the version, and the range of
/// Kubernetes releases Rustlet conforms to.
pub const LONG_VERSION: &str = concat!(
    "v1.33.3+rustlet.",
    env!("CARGO_PKG_VERSION"),
    " (conforms to the node suites of Kubernetes v1.28.7 and v1.33.3; reports the newest one not newer than its control plane)"
);

/// The kubelet version a node reports to a control plane of
/// `major.minor` (its `/version`): the newest release Rustlet conforms to
/// whose minor is not newer than the control plane's (a kubelet may not be
/// newer than its API server; 1.33 accepts kubelets from 1.30, 1.28 from
/// 1.25), the oldest where the control plane is older than all of them,
/// with `+rustlet.<version>`.
pub fn kubelet_version_for(major: &str, minor: &str) -> String {
    let number = |s: &str| s.chars().take_while(char::is_ascii_digit).collect::<String>().parse::<u32>().ok();
    let minor_of = |release: &str| release.split('.').nth(1).and_then(number);
    let chosen = match (number(major), number(minor)) {
        (Some(1), Some(minor)) => CONFORMS_TO
            .iter()
            .rev()
            .find(|release| minor_of(release).is_some_and(|m| m <= minor))
            .unwrap_or(&CONFORMS_TO[0]),
        _ => &KUBERNETES_VERSION,
    };
    format!("{chosen}+rustlet.{}", env!("CARGO_PKG_VERSION"))
}

/// Where the API client comes from.
#[derive(Clone)]
pub enum ApiSource {
    /// A client the embedder built.
    Client(kube::Client),
    /// A kubeconfig file (its current context), read when the node starts
    /// and again with backoff while it is missing or unusable.
    Kubeconfig(PathBuf),
    /// A kubeconfig made by TLS bootstrap when it has no valid client
    /// certificate, its certificate renewed if asked
    /// ([`certificates`]); retried with backoff like a kubeconfig.
    Bootstrap(certificates::BootstrapSettings),
}

impl std::fmt::Debug for ApiSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiSource::Client(_) => f.write_str("Client(..)"),
            ApiSource::Kubeconfig(path) => f.debug_tuple("Kubeconfig").field(path).finish(),
            ApiSource::Bootstrap(settings) => f.debug_tuple("Bootstrap").field(settings).finish(),
        }
    }
}

/// Settings of cluster mode.
#[derive(Clone, Debug)]
pub struct ClusterSettings {
    /// The API client.
    pub api: ApiSource,
    /// Labels the Node gets (`--node-labels`), over the node's own.
    pub node_labels: BTreeMap<String, String>,
    /// Taints the Node is registered with (`--register-with-taints`),
    /// besides the provider's.
    pub taints: Vec<Taint>,
    /// Timings of the Node and Lease writes (its `node_name` is replaced by
    /// the node's).
    pub node_sync: NodeSyncConfig,
    /// Timings of the pod writes (its `node_name` is replaced by the node's).
    pub pod_sync: PodSyncConfig,
    /// The first delay before the kubeconfig is read again (doubling up to
    /// a minute).
    pub kubeconfig_retry: Duration,
    /// Requests a second the client built from a kubeconfig sends at most,
    /// on average (`--kube-api-qps`; 0: no limit). Every request counts, as
    /// upstream's client counts them. A client given as
    /// [`ApiSource::Client`] is used as it is.
    pub api_qps: f64,
    /// Requests that client sends at once at most before `api_qps` applies
    /// (`--kube-api-burst`).
    pub api_burst: u32,
    /// Where the API's RuntimeClass objects go (the table of the node's
    /// [`crate::runtime_class::RuntimeClasses`]); `None`: they are not
    /// read (a node with one runtime).
    pub runtime_classes: Option<crate::runtime_class::ClassHandlers>,
    /// How long after a DRA driver's last instance went away its
    /// ResourceSlices of this node are deleted (upstream: 30 s).
    pub slice_wiping_delay: Duration,
    /// The series of the node's API requests and certificates.
    pub metrics: api_metrics::ApiMetrics,
}

impl ClusterSettings {
    /// Upstream's timings, with the client from `api`.
    pub fn new(api: ApiSource) -> ClusterSettings {
        ClusterSettings {
            api,
            node_labels: BTreeMap::new(),
            taints: Vec::new(),
            node_sync: NodeSyncConfig::new(""),
            pod_sync: PodSyncConfig::new(""),
            kubeconfig_retry: Duration::from_millis(500),
            api_qps: rate_limit::DEFAULT_QPS,
            api_burst: rate_limit::DEFAULT_BURST,
            runtime_classes: None,
            slice_wiping_delay: claims::SLICE_WIPING_DELAY,
            metrics: api_metrics::ApiMetrics::default(),
        }
    }
}

/// The parts of a running cluster mode, once the client is ready.
#[derive(Clone, Debug)]
pub struct Connected {
    /// The Node and Lease writer.
    pub node: NodeSync,
    /// The pod watcher and status writer.
    pub pods: PodSync,
}

/// A node's cluster mode. Cheap to clone.
#[derive(Clone)]
pub struct Cluster {
    connected: watch::Receiver<Option<Connected>>,
    csi: ApiNodeInfo,
}

impl Cluster {
    /// The running parts, once the API client is ready (`None` while the
    /// kubeconfig cannot be used).
    pub fn connected(&self) -> Option<Connected> {
        self.connected.borrow().clone()
    }

    /// Waits until the API client is ready.
    pub async fn wait_connected(&self) -> Option<Connected> {
        let mut connected = self.connected.clone();
        connected.wait_for(Option::is_some).await.ok().and_then(|c| c.clone())
    }

    /// The CSI node info writer.
    pub fn csi_info(&self) -> &ApiNodeInfo {
        &self.csi
    }
}

/// What cluster mode reads from the node.
pub struct NodeParts {
    /// The node's supervision: cluster tasks are restarted, checked and
    /// counted by it.
    pub supervision: Supervision,
    /// What describes the Node.
    pub description: NodeDescription,
    /// The device manager (capacity, allocatable devices).
    pub devices: DeviceManager,
    /// The node's checks (the Node's `Ready` condition).
    pub healthz: Healthz,
    /// The pod lifecycle the API's pods run through.
    pub pods: Pods,
    /// CSI drivers' node facts, written to the API.
    pub csi: ApiNodeInfo,
    /// CSIDriver objects, filled from the API.
    pub csi_objects: CsiDriverObjects,
    /// Gets the client once it is ready (for [`volumes::ApiVolumes`]).
    pub client: watch::Sender<Option<kube::Client>>,
    /// Gets the reviews' client once it is ready (the kubelet API's
    /// TokenReviews and SubjectAccessReviews).
    pub review_client: watch::Sender<Option<kube::Client>>,
    /// The persistent volumes published on the node (`volumesInUse`).
    pub volumes_in_use: VolumesInUse,
    /// The pod events to write to the API.
    pub events: Option<kubelet_pods::events::EventQueue>,
    /// Where node events are recorded (into `events`).
    pub recorder: kubelet_pods::events::EventRecorder,
    /// The DRA drivers (their ResourceSlices are wiped when they are gone).
    pub dra: kubelet_plugins::dra::DraDrivers,
}

/// Where cluster mode hands out an API client once it has one.
pub type ClientSender = watch::Sender<Option<kube::Client>>;

/// Where a client from cluster mode is waited for.
pub type ClientReceiver = watch::Receiver<Option<kube::Client>>;

/// Persistent volumes published on the node, by unique name, with their pods.
pub type VolumesInUse = watch::Receiver<BTreeMap<String, std::collections::BTreeSet<String>>>;

/// Starts cluster mode for a started node; nothing here blocks the node.
pub fn start(settings: ClusterSettings, parts: NodeParts, shutdown: CancellationToken) -> Cluster {
    let (connected_tx, connected) = watch::channel(None);
    let cluster = Cluster { connected, csi: parts.csi.clone() };
    let mut description = parts.description;
    description.labels.extend(settings.node_labels.clone());
    description.taints.extend(settings.taints.iter().cloned());
    let name = description.name.clone();
    let supervision = parts.supervision.clone();
    // Joining is one job: it ends once every cluster task is started.
    parts.supervision.clone().once("cluster-join", async move {
        let clients = tokio::select! {
            () = shutdown.cancelled() => return,
            clients = client(&settings, &name, &supervision) => clients,
        };
        parts.review_client.send_replace(Some(clients.reviews.clone()));
        let client = clients.main.clone();
        parts.recorder.node(&name, crate::events::EventType::Normal, "Starting", "Starting kubelet.".into());
        if let Some(queue) = parts.events {
            let (events_client, node, stop) = (client.clone(), name.clone(), shutdown.clone());
            // Supervised below (watched, not restarted): the queue is the task's.
            let publisher = tokio::spawn(async move {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = api_events::publish(events_client, &node, queue) => {}
                }
            });
            supervision.watch("cluster-events", publisher);
        }
        tracing::info!(node = %name, "API client ready; joining the cluster");
        // The version the Node reports: what this control plane accepts.
        match client.apiserver_version().await {
            Ok(info) => {
                description.kubelet_version = kubelet_version_for(&info.major, &info.minor);
                tracing::info!(control_plane = %info.git_version, kubelet_version = %description.kubelet_version, "the Node reports the newest conformed Kubernetes version the control plane accepts");
            }
            Err(error) => {
                tracing::warn!(error = %describe(&error), kubelet_version = %description.kubelet_version, "cannot read the control plane's /version; the Node reports the newest conformed version");
            }
        }
        let desired = follow_node(description, parts.devices, parts.healthz.clone(), parts.volumes_in_use, &supervision);
        let node = node_sync::start_with_heartbeat(
            client.clone(),
            clients.heartbeat.clone(),
            NodeSyncConfig { node_name: name.clone(), events: parts.recorder.clone(), ..settings.node_sync },
            desired,
            supervision.clone(),
        );
        parts.csi.start(client.clone(), &name, node.registered(), supervision.clone());
        parts.client.send_replace(Some(client.clone()));
        {
            let (slices_client, node, drivers, stop) = (client.clone(), name.clone(), parts.dra, shutdown.clone());
            let delay = settings.slice_wiping_delay;
            // Supervised below (watched, not restarted): a new run would first delete every
            // slice of the node, those of the drivers still connected too.
            let wiping = tokio::spawn(claims::wipe_slices(slices_client, node, drivers, delay, stop));
            supervision.watch("cluster-dra-slice-wiping", wiping);
        }
        let (drivers_client, objects) = (client.clone(), parts.csi_objects);
        supervision.spawn("cluster-csidriver-watch", move || {
            volumes::follow_csi_drivers(drivers_client.clone(), objects.clone())
        });
        if let Some(classes) = settings.runtime_classes.clone() {
            classes.from_api();
            let classes_client = client.clone();
            supervision.spawn("cluster-runtimeclass-watch", move || {
                runtime_classes::follow(classes_client.clone(), classes.clone())
            });
        }
        let pods = pod_sync::start(
            client,
            PodSyncConfig { node_name: name.clone(), ..settings.pod_sync },
            parts.pods,
            supervision,
        );
        connected_tx.send_replace(Some(Connected { node, pods }));
    });
    cluster
}

/// The node's API clients. Built from a kubeconfig, each has its own
/// connections and its own request bucket, so that no caller waits behind
/// another's: the heartbeat (the Lease and the Node's status, unlimited as
/// upstream's heartbeat client, since its rate is bounded by its periods),
/// the reviews of the kubelet API's callers (TokenReview and
/// SubjectAccessReview: `--kube-api-qps`/`--kube-api-burst` of their own),
/// and everything else. A client given as [`ApiSource::Client`] serves all
/// three.
#[derive(Clone)]
pub(crate) struct ApiClients {
    pub(crate) main: kube::Client,
    pub(crate) heartbeat: kube::Client,
    pub(crate) reviews: kube::Client,
}

impl ApiClients {
    fn one(client: kube::Client) -> ApiClients {
        ApiClients { main: client.clone(), heartbeat: client.clone(), reviews: client }
    }
}

/// The API clients: the given one, or ones from the kubeconfig, read again
/// with backoff until it works.
async fn client(settings: &ClusterSettings, node_name: &str, supervision: &Supervision) -> ApiClients {
    let shutdown = supervision.shutdown();
    let path = match &settings.api {
        ApiSource::Client(client) => return ApiClients::one(client.clone()),
        ApiSource::Kubeconfig(path) => path,
        ApiSource::Bootstrap(bootstrap) => &bootstrap.kubeconfig,
    };
    let mut backoff = crate::retry::RetryBackoff::new(settings.kubeconfig_retry, Duration::from_secs(60));
    loop {
        let made = match &settings.api {
            ApiSource::Bootstrap(bootstrap) => match certificates::bootstrap(bootstrap, node_name, shutdown).await {
                Ok(true) => {
                    let (qps, burst) = (settings.api_qps, settings.api_burst);
                    certificates::rotating_clients(
                        bootstrap,
                        node_name,
                        &settings.metrics,
                        &[(qps, burst), (0.0, 0), (qps, burst)],
                        supervision,
                    )
                    .await
                    .map_err(|e| e.to_string())
                    .map(|mut clients| {
                        let reviews = clients.pop().unwrap_or_else(|| clients[0].clone());
                        let heartbeat = clients.pop().unwrap_or_else(|| clients[0].clone());
                        ApiClients { main: clients.remove(0), heartbeat, reviews }
                    })
                }
                // Stopping: the caller sees the shutdown.
                Ok(false) => std::future::pending().await,
                Err(error) => Err(error.to_string()),
            },
            _ => async {
                let metrics = Some(&settings.metrics);
                let main = from_kubeconfig_limited(path, settings.api_qps, settings.api_burst, metrics).await?;
                let heartbeat = from_kubeconfig_limited(path, 0.0, 0, metrics).await?;
                let reviews = from_kubeconfig_limited(path, settings.api_qps, settings.api_burst, metrics).await?;
                Ok::<_, KubeconfigError>(ApiClients { main, heartbeat, reviews })
            }
            .await
            .map_err(|e| e.to_string()),
        };
        match made {
            Ok(client) => return client,
            Err(error) => {
                let delay = backoff.next_delay();
                tracing::error!(
                    kubeconfig = %path.display(),
                    %error,
                    retry_in = ?delay,
                    "cannot connect to the cluster; the node keeps running standalone parts and retries"
                );
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Why a kubeconfig cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    /// The file is missing or not a kubeconfig.
    #[error("cannot read the kubeconfig: {0}")]
    Read(String),
    /// Its current context does not make a client.
    #[error("the kubeconfig does not make an API client: {0}")]
    Client(String),
}

/// A client from the current context of the kubeconfig at `path`.
pub async fn from_kubeconfig(path: &std::path::Path) -> Result<kube::Client, KubeconfigError> {
    from_kubeconfig_limited(path, 0.0, 0, None).await
}

/// A client from the kubeconfig at `path` whose requests go out at `qps` a
/// second on average and `burst` at once at most (a `qps` of 0: no limit):
/// [`rate_limit::RateLimitLayer`] under kube's own layers; its requests
/// counted in `metrics` if given.
pub(crate) async fn from_kubeconfig_limited(
    path: &std::path::Path,
    qps: f64,
    burst: u32,
    metrics: Option<&api_metrics::ApiMetrics>,
) -> Result<kube::Client, KubeconfigError> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(|e| KubeconfigError::Read(error_chain(&e)))?;
    let options = kube::config::KubeConfigOptions::default();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .map_err(|e| KubeconfigError::Client(error_chain(&e)))?;
    let host = api_metrics::url_host(&config.cluster_url);
    let builder =
        kube::client::ClientBuilder::try_from(config).map_err(|e| KubeconfigError::Client(error_chain(&e)))?;
    let builder = builder.with_layer(&rate_limit::RateLimitLayer::new(qps, burst));
    Ok(match metrics {
        Some(metrics) => builder.with_layer(&metrics.layer(host)).build(),
        None => builder.build(),
    })
}

/// The Node as the node describes it now, recomputed when a device
/// resource, a health check, the node's pressure or the volumes in use
/// change.
fn follow_node(
    description: NodeDescription,
    devices: DeviceManager,
    healthz: Healthz,
    mut in_use: VolumesInUse,
    supervision: &Supervision,
) -> watch::Receiver<Node> {
    let mut capacity = devices.capacity();
    let mut pressure = description.pressure.subscribe();
    let checks = healthz.clone();
    let describe = move |capacity: &BTreeMap<_, _>, in_use: &BTreeMap<String, _>| {
        let mut node = description.object(capacity, &checks);
        if let Some(status) = node.status.as_mut() {
            // Sent even when empty: a merge patch would keep the last list.
            status.volumes_in_use = Some(in_use.keys().cloned().collect());
        }
        node
    };
    let (tx, rx) = watch::channel(describe(&capacity.borrow_and_update(), &in_use.borrow_and_update()));
    // Every health check's changes, as one stream (a check whose reporter
    // is gone drops out of it).
    let mut health = futures_util::stream::select_all(
        healthz
            .report()
            .iter()
            .filter_map(|check| healthz.watch(&check.name))
            .map(tokio_stream::wrappers::WatchStream::from_changes),
    );
    let shutdown = supervision.shutdown().clone();
    // Supervised below (watched, not restarted): the senders are the task's.
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = capacity.changed() => if changed.is_err() { return },
                changed = in_use.changed() => if changed.is_err() { return },
                changed = pressure.changed() => if changed.is_err() { return },
                Some(_) = futures_util::StreamExt::next(&mut health) => {}
            }
            let node = describe(&capacity.borrow_and_update(), &in_use.borrow_and_update());
            tx.send_replace(node);
        }
    });
    supervision.watch("node-description", task);
    rx
}

/// Parameters of every patch the node sends (its field manager).
pub(crate) fn patch_params() -> kube::api::PatchParams {
    kube::api::PatchParams { field_manager: Some(pod_sync::FIELD_MANAGER.into()), ..Default::default() }
}

/// Parameters of every create and replace the node sends (its field manager).
pub(crate) fn post_params() -> kube::api::PostParams {
    kube::api::PostParams { field_manager: Some(pod_sync::FIELD_MANAGER.into()), ..Default::default() }
}

/// Whether the API answered `code`.
pub(crate) fn is_code(error: &kube::Error, code: u16) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == code)
}

pub(crate) fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => format!("{} {}: {}", status.code, status.reason, status.message),
        other => error_chain(other),
    }
}
