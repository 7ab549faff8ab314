//! The pod lifecycle's series, with the kubelet's names, types, labels and
//! buckets (v1.28, `pkg/kubelet/metrics` and the prober), so that the
//! dashboards and alerts written for the kubelet read them unchanged.
//!
//! On `/metrics` ([`PodMetrics::register`]):
//! - `kubelet_running_pods`, `kubelet_running_containers{container_state}`:
//!   what the last relist of the runtime found (see below), and the pod
//!   store's exited containers;
//! - `kubelet_pod_start_duration_seconds`: from the node first seeing a pod
//!   to all its containers started (image pulls and init containers
//!   included), once per pod;
//! - `kubelet_pod_worker_duration_seconds{operation_type}`: `create`, the
//!   same span (upstream's first sync of a pod pulls and starts it too);
//!   `kill`, from the removal's start to its end (Rustlet has no periodic
//!   `sync` and applies updates as they come, untimed);
//! - `kubelet_started_pods_total`, `kubelet_started_pods_errors_total`:
//!   pod sandboxes (the provider's `prepare_pod`) made and failed;
//! - `kubelet_started_containers_total{container_type}`,
//!   `kubelet_started_containers_errors_total{container_type,code}`;
//! - `kubelet_runtime_operations_total`, `…_errors_total` and
//!   `…_duration_seconds{operation_type}`: every provider call
//!   ([`MeteredProvider`]), named as the CRI call it makes;
//! - `kubelet_pleg_relist_duration_seconds`,
//!   `kubelet_pleg_relist_interval_seconds`, `kubelet_pleg_last_seen_seconds`:
//!   Rustlet learns of container exits from the runtime's events, not by
//!   relisting every second; its relist (`pod::relist`) is the safety net
//!   that lists the runtime's containers every [`RELIST_PERIOD`], and these
//!   series time it;
//! - `kubelet_evictions{eviction_signal}`.
//!
//! On `/metrics/probes` ([`ProbeMetrics`]): `prober_probe_total` and
//! `prober_probe_duration_seconds`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kubelet_support::metrics::{DEFAULT_BUCKETS, ScrapeFamily, exponential_buckets};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// How often the relist lists the runtime's containers.
pub(crate) const RELIST_PERIOD: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationType {
    operation_type: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ContainerType {
    container_type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ContainerError {
    container_type: &'static str,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EvictionSignal {
    eviction_signal: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn default_histogram() -> Histogram {
    Histogram::new(DEFAULT_BUCKETS)
}

/// `ExponentialBuckets(.005, 2.5, 14)`, upstream's for runtime operations.
fn runtime_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.5, 14))
}

/// What the last relist found.
#[derive(Clone, Debug, Default)]
struct Relisted {
    /// Pods with a running container.
    pods: usize,
    /// Running containers.
    running: usize,
}

/// The pod lifecycle's series; clones share their values.
#[derive(Clone)]
pub struct PodMetrics {
    pod_start: Histogram,
    pod_worker: HistogramFamily<OperationType>,
    started_pods: Counter,
    started_pods_errors: Counter,
    started_containers: Family<ContainerType, Counter>,
    started_containers_errors: Family<ContainerError, Counter>,
    runtime_operations: Family<OperationType, Counter>,
    runtime_errors: Family<OperationType, Counter>,
    runtime_duration: HistogramFamily<OperationType>,
    relist_duration: Histogram,
    relist_interval: Histogram,
    last_relist: Arc<Mutex<Option<(Instant, jiff::Timestamp)>>>,
    relisted: Arc<Mutex<Relisted>>,
    evictions: Family<EvictionSignal, Counter>,
    probes: ProbeMetrics,
}

impl Default for PodMetrics {
    fn default() -> Self {
        PodMetrics {
            pod_start: Histogram::new(DEFAULT_BUCKETS),
            pod_worker: Family::new_with_constructor(default_histogram),
            started_pods: Counter::default(),
            started_pods_errors: Counter::default(),
            started_containers: Family::default(),
            started_containers_errors: Family::default(),
            runtime_operations: Family::default(),
            runtime_errors: Family::default(),
            runtime_duration: Family::new_with_constructor(runtime_histogram),
            relist_duration: Histogram::new(DEFAULT_BUCKETS),
            relist_interval: Histogram::new(DEFAULT_BUCKETS),
            last_relist: Arc::default(),
            relisted: Arc::default(),
            evictions: Family::default(),
            probes: ProbeMetrics::default(),
        }
    }
}

impl std::fmt::Debug for PodMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodMetrics").finish_non_exhaustive()
    }
}

impl PodMetrics {
    /// Registers the `/metrics` series into `registry`; `exited` counts the
    /// pod store's exited containers at each scrape.
    pub fn register(&self, registry: &mut Registry, exited: impl Fn() -> usize + Send + Sync + 'static) {
        let relisted = Arc::clone(&self.relisted);
        registry.register_collector(ScrapeFamily::gauge(
            "kubelet_running_pods",
            "[ALPHA] Number of pods that have a running pod sandbox",
            &[],
            move || vec![(Vec::new(), lock(&relisted).pods as f64)],
        ));
        let relisted = Arc::clone(&self.relisted);
        registry.register_collector(ScrapeFamily::gauge(
            "kubelet_running_containers",
            "[ALPHA] Number of containers currently running",
            &["container_state"],
            move || {
                vec![
                    (vec!["running".to_owned()], lock(&relisted).running as f64),
                    (vec!["exited".to_owned()], exited() as f64),
                ]
            },
        ));
        let last = Arc::clone(&self.last_relist);
        registry.register_collector(ScrapeFamily::gauge(
            "kubelet_pleg_last_seen_seconds",
            "[ALPHA] Timestamp in seconds when PLEG was last seen active.",
            &[],
            move || lock(&last).map(|(_, at)| (Vec::new(), at.as_millisecond() as f64 / 1e3)).into_iter().collect(),
        ));
        registry.register(
            "kubelet_pod_start_duration_seconds",
            "[ALPHA] Duration in seconds from kubelet seeing a pod for the first time to the pod starting to run",
            self.pod_start.clone(),
        );
        // Present from the start, at zero: a rate over the first pod's
        // start needs a sample from before it.
        for operation_type in ["create", "kill"] {
            let _ = self.pod_worker.get_or_create(&OperationType { operation_type: operation_type.to_owned() });
        }
        registry.register(
            "kubelet_pod_worker_duration_seconds",
            "[ALPHA] Duration in seconds to sync a single pod. Broken down by operation type: create, update, or sync",
            self.pod_worker.clone(),
        );
        registry.register(
            "kubelet_started_pods_total",
            "[ALPHA] Cumulative number of pods started",
            self.started_pods.clone(),
        );
        registry.register(
            "kubelet_started_pods_errors_total",
            "[ALPHA] Cumulative number of errors when starting pods",
            self.started_pods_errors.clone(),
        );
        registry.register(
            "kubelet_started_containers_total",
            "[ALPHA] Cumulative number of containers started",
            self.started_containers.clone(),
        );
        registry.register(
            "kubelet_started_containers_errors_total",
            "[ALPHA] Cumulative number of errors when starting containers",
            self.started_containers_errors.clone(),
        );
        registry.register(
            "kubelet_runtime_operations_total",
            "[ALPHA] Cumulative number of runtime operations by operation type.",
            self.runtime_operations.clone(),
        );
        registry.register(
            "kubelet_runtime_operations_errors_total",
            "[ALPHA] Cumulative number of runtime operation errors by operation type.",
            self.runtime_errors.clone(),
        );
        registry.register(
            "kubelet_runtime_operations_duration_seconds",
            "[ALPHA] Duration in seconds of runtime operations. Broken down by operation type.",
            self.runtime_duration.clone(),
        );
        registry.register(
            "kubelet_pleg_relist_duration_seconds",
            "[ALPHA] Duration in seconds for relisting pods in PLEG.",
            self.relist_duration.clone(),
        );
        registry.register(
            "kubelet_pleg_relist_interval_seconds",
            "[ALPHA] Interval in seconds between relisting in PLEG.",
            self.relist_interval.clone(),
        );
        registry.register(
            "kubelet_evictions",
            "[ALPHA] Cumulative number of pod evictions by eviction signal",
            self.evictions.clone(),
        );
    }

    /// The `/metrics/probes` series.
    pub fn probes(&self) -> &ProbeMetrics {
        &self.probes
    }

    /// A pod started: `took` since the node first saw it.
    pub(crate) fn pod_started(&self, took: Duration) {
        self.pod_start.observe(took.as_secs_f64());
        self.pod_worker(WorkerOperation::Create, took);
    }

    /// One pod worker operation took `took`.
    pub(crate) fn pod_worker(&self, operation: WorkerOperation, took: Duration) {
        let operation_type = match operation {
            WorkerOperation::Create => "create",
            WorkerOperation::Kill => "kill",
        };
        self.pod_worker
            .get_or_create(&OperationType { operation_type: operation_type.to_owned() })
            .observe(took.as_secs_f64());
    }

    /// A pod sandbox was made, or failed to be.
    pub(crate) fn sandbox(&self, ok: bool) {
        self.started_pods.inc();
        if !ok {
            self.started_pods_errors.inc();
        }
    }

    /// A container of `kind` is started; `failure` is the reason it failed.
    pub(crate) fn container_start(&self, kind: kubelet_provider::ContainerKind, failure: Option<&str>) {
        let container_type = match kind {
            kubelet_provider::ContainerKind::Init => "init_container",
            kubelet_provider::ContainerKind::Ephemeral => "ephemeral_container",
            _ => "container",
        };
        self.started_containers.get_or_create(&ContainerType { container_type }).inc();
        if let Some(code) = failure {
            self.started_containers_errors
                .get_or_create(&ContainerError { container_type, code: code.to_owned() })
                .inc();
        }
    }

    /// One runtime call `operation` took `took`, failed or not.
    pub(crate) fn runtime_operation(&self, operation: &'static str, took: Duration, ok: bool) {
        let labels = OperationType { operation_type: operation.to_owned() };
        self.runtime_operations.get_or_create(&labels).inc();
        self.runtime_duration.get_or_create(&labels).observe(took.as_secs_f64());
        if !ok {
            self.runtime_errors.get_or_create(&labels).inc();
        }
    }

    /// A pod was evicted for `signal`.
    pub(crate) fn evicted(&self, signal: &str) {
        self.evictions.get_or_create(&EvictionSignal { eviction_signal: signal.to_owned() }).inc();
    }

    /// One relist began at `began` and found `running` (pod UID of each
    /// running container).
    pub(crate) fn relisted(&self, began: Instant, running: &[String]) {
        let took = began.elapsed();
        self.relist_duration.observe(took.as_secs_f64());
        let mut last = lock(&self.last_relist);
        if let Some((previous, _)) = *last {
            self.relist_interval.observe(began.saturating_duration_since(previous).as_secs_f64());
        }
        *last = Some((began, jiff::Timestamp::now()));
        let pods = running.iter().collect::<HashSet<_>>().len();
        *lock(&self.relisted) = Relisted { pods, running: running.len() };
    }
}

/// What a pod worker did.
#[derive(Clone, Copy, Debug)]
pub(crate) enum WorkerOperation {
    /// Started a new pod.
    Create,
    /// Removed a pod.
    Kill,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeTotal {
    probe_type: &'static str,
    result: &'static str,
    container: String,
    pod: String,
    namespace: String,
    pod_uid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeDuration {
    probe_type: &'static str,
    container: String,
    pod: String,
    namespace: String,
}

/// The prober's series (`/metrics/probes`); clones share their values.
#[derive(Clone)]
pub struct ProbeMetrics {
    total: Family<ProbeTotal, Counter>,
    duration: HistogramFamily<ProbeDuration>,
}

impl Default for ProbeMetrics {
    fn default() -> Self {
        ProbeMetrics { total: Family::default(), duration: Family::new_with_constructor(default_histogram) }
    }
}

impl std::fmt::Debug for ProbeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProbeMetrics").finish_non_exhaustive()
    }
}

/// Which probe of which container.
#[derive(Clone, Debug)]
pub(crate) struct ProbeIdentity {
    pub(crate) probe_type: &'static str,
    pub(crate) container: String,
    pub(crate) pod: String,
    pub(crate) namespace: String,
    pub(crate) pod_uid: String,
}

impl ProbeMetrics {
    /// Registers the series into `registry` (the `/metrics/probes` one).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "prober_probe_total",
            "[ALPHA] Cumulative number of a liveness, readiness or startup probe for a container by result.",
            self.total.clone(),
        );
        registry.register(
            "prober_probe_duration_seconds",
            "[ALPHA] Duration in seconds for a probe response.",
            self.duration.clone(),
        );
    }

    /// One probe ran: `healthy` (`None`: it could not run, upstream's
    /// `unknown`), taking `took`. As upstream, a failed probe's duration is
    /// not recorded.
    pub(crate) fn observe(&self, probe: &ProbeIdentity, healthy: Option<bool>, took: Duration) {
        let result = match healthy {
            Some(true) => "successful",
            Some(false) => "failed",
            None => "unknown",
        };
        self.total.get_or_create(&probe.total_labels(result)).inc();
        if healthy != Some(false) {
            self.duration.get_or_create(&probe.duration_labels()).observe(took.as_secs_f64());
        }
    }

    /// A probe worker stopped: its series go, as upstream deletes them.
    pub(crate) fn forget(&self, probe: &ProbeIdentity) {
        for result in ["successful", "failed", "unknown"] {
            self.total.remove(&probe.total_labels(result));
        }
        self.duration.remove(&probe.duration_labels());
    }
}

impl ProbeIdentity {
    fn total_labels(&self, result: &'static str) -> ProbeTotal {
        ProbeTotal {
            probe_type: self.probe_type,
            result,
            container: self.container.clone(),
            pod: self.pod.clone(),
            namespace: self.namespace.clone(),
            pod_uid: self.pod_uid.clone(),
        }
    }

    fn duration_labels(&self) -> ProbeDuration {
        ProbeDuration {
            probe_type: self.probe_type,
            container: self.container.clone(),
            pod: self.pod.clone(),
            namespace: self.namespace.clone(),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A provider whose calls are counted and timed in
/// `kubelet_runtime_operations_*`, each under the name of the CRI call it
/// stands for (`prepare_pod` is `run_podsandbox`, `prepare_image`
/// `pull_image`, `running_containers` `list_containers`, …). Waiting for a
/// container's exit is not an operation and is not counted; a call the
/// provider does not support is not counted either.
pub struct MeteredProvider {
    inner: Arc<dyn Provider>,
    metrics: PodMetrics,
}

impl MeteredProvider {
    /// `inner`, its calls recorded in `metrics`.
    pub fn wrap(inner: Arc<dyn Provider>, metrics: PodMetrics) -> Arc<dyn Provider> {
        Arc::new(MeteredProvider { inner, metrics })
    }

    async fn timed<T>(
        &self,
        operation: &'static str,
        call: impl std::future::Future<Output = Result<T, ProviderError>>,
    ) -> Result<T, ProviderError> {
        let began = Instant::now();
        let result = call.await;
        match &result {
            Err(error) if error.kind == ProviderErrorKind::Unsupported => {}
            outcome => self.metrics.runtime_operation(operation, began.elapsed(), outcome.is_ok()),
        }
        result
    }
}

use k8s_openapi::api::core::v1::{Container, Pod, Taint};
use kubelet_provider::{
    ContainerExit, ContainerGcReport, ContainerId, ContainerLaunch, ContainerStats, ExecOutput, ImageGcPolicy,
    ImageGcReport, PodStats, PreparedImage, Provider, ProviderError, ProviderErrorKind, PullSecrets, RunningContainer,
    StreamRequest, StreamingEndpoint,
};

#[async_trait::async_trait]
impl Provider for MeteredProvider {
    async fn prepare_image(&self, pod: &Pod, container: &Container) -> Result<PreparedImage, ProviderError> {
        self.timed("pull_image", self.inner.prepare_image(pod, container)).await
    }

    async fn prepare_image_with_secrets(
        &self,
        pod: &Pod,
        container: &Container,
        secrets: &PullSecrets,
    ) -> Result<PreparedImage, ProviderError> {
        self.timed("pull_image", self.inner.prepare_image_with_secrets(pod, container, secrets)).await
    }

    async fn start_container(&self, launch: &ContainerLaunch) -> Result<ContainerId, ProviderError> {
        self.timed("start_container", self.inner.start_container(launch)).await
    }

    async fn wait_container(&self, id: &ContainerId) -> Result<ContainerExit, ProviderError> {
        self.inner.wait_container(id).await
    }

    async fn stop_container(&self, id: &ContainerId, grace: Duration) -> Result<(), ProviderError> {
        self.timed("stop_container", self.inner.stop_container(id, grace)).await
    }

    async fn running_containers(&self) -> Result<Vec<RunningContainer>, ProviderError> {
        self.timed("list_containers", self.inner.running_containers()).await
    }

    async fn list_running(&self) -> Result<Vec<(String, ContainerId)>, ProviderError> {
        self.timed("list_containers", self.inner.list_running()).await
    }

    async fn exec_sync(
        &self,
        id: &ContainerId,
        command: &[String],
        timeout: Duration,
    ) -> Result<ExecOutput, ProviderError> {
        self.timed("exec_sync", self.inner.exec_sync(id, command, timeout)).await
    }

    async fn exec(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        self.timed("exec", self.inner.exec(id, request)).await
    }

    async fn attach(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        self.timed("attach", self.inner.attach(id, request)).await
    }

    async fn port_forward(&self, pod_uid: &str, ports: &[u16]) -> Result<StreamingEndpoint, ProviderError> {
        self.timed("port_forward", self.inner.port_forward(pod_uid, ports)).await
    }

    async fn container_stats(&self, id: &ContainerId) -> Result<ContainerStats, ProviderError> {
        self.timed("container_stats", self.inner.container_stats(id)).await
    }

    async fn started_at(&self, id: &ContainerId) -> Result<jiff::Timestamp, ProviderError> {
        self.timed("container_status", self.inner.started_at(id)).await
    }

    async fn pod_stats(&self, pod: &Pod) -> Result<PodStats, ProviderError> {
        self.timed("podsandbox_stats", self.inner.pod_stats(pod)).await
    }

    async fn pod_ips(&self, pod_uid: &str) -> Vec<std::net::IpAddr> {
        self.inner.pod_ips(pod_uid).await
    }

    async fn prepare_pod(
        &self,
        pod: &Pod,
        log_directory: &std::path::Path,
    ) -> Result<Vec<std::net::IpAddr>, ProviderError> {
        self.timed("run_podsandbox", self.inner.prepare_pod(pod, log_directory)).await
    }

    fn mounts_files(&self, pod: &Pod) -> bool {
        self.inner.mounts_files(pod)
    }

    fn reads_cdi(&self, pod: &Pod) -> bool {
        self.inner.reads_cdi(pod)
    }

    async fn update_container_resources(
        &self,
        pod: &Pod,
        id: &ContainerId,
        container: &Container,
    ) -> Result<(), ProviderError> {
        self.timed("update_container", self.inner.update_container_resources(pod, id, container)).await
    }

    async fn update_pod_resources(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.inner.update_pod_resources(pod).await
    }

    fn runtime_version(&self) -> String {
        self.inner.runtime_version()
    }

    fn supports_strict_supplemental_groups(&self) -> bool {
        self.inner.supports_strict_supplemental_groups()
    }

    fn network_readiness(&self, pod: &Pod) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        self.inner.network_readiness(pod)
    }

    async fn remove_pod(&self, pod_uid: &str) -> Result<(), ProviderError> {
        self.timed("remove_podsandbox", self.inner.remove_pod(pod_uid)).await
    }

    fn runtime_type(&self, pod: &Pod) -> String {
        self.inner.runtime_type(pod)
    }

    fn node_labels(&self) -> std::collections::BTreeMap<String, String> {
        self.inner.node_labels()
    }

    fn node_taints(&self) -> Vec<Taint> {
        self.inner.node_taints()
    }

    fn pod_overhead(&self, pod: &Pod) -> u128 {
        self.inner.pod_overhead(pod)
    }

    fn pod_ceiling(&self) -> Option<(usize, String)> {
        self.inner.pod_ceiling()
    }

    async fn collect_containers(&self, keep: usize) -> Result<ContainerGcReport, ProviderError> {
        self.timed("remove_container", self.inner.collect_containers(keep)).await
    }

    async fn collect_images(&self, policy: &ImageGcPolicy, all_unused: bool) -> Result<ImageGcReport, ProviderError> {
        self.timed("remove_image", self.inner.collect_images(policy, all_unused)).await
    }

    async fn reopen_container_log(&self, id: &ContainerId) -> Result<(), ProviderError> {
        self.timed("reopen_container_log", self.inner.reopen_container_log(id)).await
    }

    async fn image_fs_path(&self) -> Option<std::path::PathBuf> {
        self.inner.image_fs_path().await
    }

    async fn runtime_process(&self) -> Option<u32> {
        self.inner.runtime_process().await
    }
}
