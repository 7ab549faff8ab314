//! The contract between Rustlet's node and a provider: the [`Provider`]
//! trait and every type it speaks. A provider author depends on this crate
//! (and `kubelet-api` for wire types it uses); the `kubelet` crate (the
//! facade) is needed only to run a node. What the node runs with (health
//! checks, the supervisor, retry backoff, durable files, cgroups, the
//! metrics text format) is in `kubelet-support`, which a provider may use
//! but need not read.
//!
//! - The crate root: the [`Provider`] trait, what a container is started
//!   with ([`ContainerLaunch`], [`ContainerRunOptions`], [`Mount`],
//!   [`DeviceNode`]), how it ended ([`ContainerExit`]), streaming sessions,
//!   stats, the CRI log format and [`ProviderError`].
//! - [`quantity`], [`hostname`] and [`qos`]: Kubernetes quantities, pod
//!   hostnames, QoS classes and OOM score adjustments as the kubelet
//!   computes them.
//!
//! # The provider
//! A provider turns a container's run options into something running (a
//! process, a WebAssembly instance, a CRI container) and reports how it ended.
//! It never sees plugins: devices arrive as env, mounts and device nodes in
//! [`ContainerRunOptions`], volumes as host paths to expose at container
//! paths. The pod lifecycle decides when to pull, start, stop and restart.
//!
//! ## Contract
//! - `prepare_image` may be called again for an image already present; it is
//!   the provider's cache to keep.
//! - `start_container` returns once the container runs (or fails to start).
//!   The container writes its output to [`ContainerLaunch::log_path`] in the
//!   CRI log format (`<RFC 3339 time> <stdout|stderr> F <line>`), which the
//!   node reads for `rustlet logs`.
//! - `wait_container` may be called more than once for one container, also
//!   after a restart of the node for containers listed by
//!   `running_containers`; it must be cancel-safe.
//! - `stop_container` asks the container to stop and kills it when the grace
//!   period runs out; it returns once the container no longer runs.

pub mod hostname;
pub mod qos;
pub mod quantity;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::jiff::Timestamp;

/// What kind of container a pod runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ContainerKind {
    /// An init container that runs to completion before the next one.
    Init,
    /// A restartable init container (sidecar): runs alongside the app containers.
    RestartableInit,
    /// An app container.
    App,
    /// An ephemeral container (`kubectl debug`): added to a running pod,
    /// run once, never restarted; it has no resources and no devices.
    Ephemeral,
}

/// A device node made available in the container.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Any of `r`, `w`, `m`.
    pub permissions: String,
}

/// A provider's name for one container it runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct ContainerId(pub String);

impl std::fmt::Display for ContainerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One environment variable, in the order the container sees them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct EnvVar {
    /// Name.
    pub name: String,
    /// Value.
    pub value: String,
}

/// A host path exposed to the container.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// Where the container sees it.
    pub container_path: String,
    /// What it is on the host (a prepared volume, or a device plugin's mount).
    pub host_path: PathBuf,
    /// Read-only.
    pub read_only: bool,
    /// The pod volume it comes from; `None` for a device plugin's mount.
    pub volume: Option<String>,
    /// Whether mounts made later beneath it cross between the host and the
    /// container (the volume mount's `mountPropagation`).
    pub propagation: MountPropagation,
}

/// A mount's propagation, as the kubelet sends it through CRI: which way
/// mounts made beneath the mount point after the container starts travel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum MountPropagation {
    /// Neither way (`None`, or no `mountPropagation`; the runtime's
    /// `rprivate`).
    #[default]
    Private,
    /// From the host into the container (`HostToContainer`; `rslave`): a
    /// volume mounted on the host later is seen inside.
    HostToContainer,
    /// Both ways (`Bidirectional`; `rshared`; privileged containers only): a
    /// mount the container makes reaches the host and every other container
    /// of the same host path. What a CSI driver's pod asks for its
    /// `<root-dir>/pods` and `<root-dir>/plugins`.
    Bidirectional,
}

/// Everything a container is run with, in one value: the spec's command and
/// env merged with what its devices and volumes add.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerRunOptions {
    /// `command` (the image's entrypoint is overridden when set).
    pub command: Vec<String>,
    /// `args`.
    pub args: Vec<String>,
    /// `workingDir`.
    pub working_dir: Option<String>,
    /// The spec's env (values resolved), then the devices' env; a device env
    /// var overrides a spec one of the same name, as upstream.
    pub env: Vec<EnvVar>,
    /// Volume mounts, then device mounts.
    pub mounts: Vec<Mount>,
    /// Device nodes from device plugins.
    pub devices: Vec<DeviceNode>,
    /// Annotations from device plugins.
    pub annotations: BTreeMap<String, String>,
    /// Fully qualified CDI device names, from device plugins and resource
    /// claims (the runtime's to apply when it reads CDI; otherwise the
    /// node has added their edits to the fields above).
    pub cdi_devices: Vec<String>,
}

impl ContainerRunOptions {
    /// The value of env var `name`, if set.
    pub fn env_value(&self, name: &str) -> Option<&str> {
        self.env.iter().find(|e| e.name == name).map(|e| e.value.as_str())
    }
}

/// What the provider is asked to start.
#[derive(Clone, Debug)]
pub struct ContainerLaunch {
    /// The pod.
    pub pod: Arc<Pod>,
    /// The container's spec.
    pub container: Container,
    /// Init, sidecar or app container.
    pub kind: ContainerKind,
    /// How many times this container was restarted before (0 on the first
    /// start).
    pub restart_count: u32,
    /// What the container runs with.
    pub run_options: ContainerRunOptions,
    /// Where the container's output goes (CRI log format), under
    /// `<root-dir>/logs/pods/<namespace>_<name>_<uid>/<container>/<restart>.log`.
    pub log_path: PathBuf,
    /// An ephemeral container's target (`targetContainerName`): the running
    /// container whose process namespace it joins.
    pub target: Option<ContainerId>,
}

/// How a container ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerExit {
    /// The exit code (128 + signal for a container killed by a signal).
    pub exit_code: i32,
    /// A reason the provider knows better than the exit code (`OOMKilled`).
    pub reason: Option<String>,
    /// A message for the container status.
    pub message: Option<String>,
    /// When it ended.
    pub finished_at: Timestamp,
}

/// A container the provider still runs, as it reports after a restart of
/// the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunningContainer {
    /// The provider's id.
    pub id: ContainerId,
    /// The pod's UID.
    pub pod_uid: String,
    /// The container's name.
    pub container_name: String,
    /// The restart count it was started with.
    pub restart_count: u32,
    /// When it started.
    pub started_at: Timestamp,
}

/// An image ready to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedImage {
    /// The image's id (a digest), for `imageID` in the container status.
    pub image_id: String,
}

/// `imagePullPolicy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullPolicy {
    /// Resolve the reference at every start; fetch what changed.
    Always,
    /// Pull only when the image is not there.
    IfNotPresent,
    /// Never pull.
    Never,
}

impl PullPolicy {
    /// The container's policy: its own, else upstream's default (`Always`
    /// for `:latest` or no tag, `IfNotPresent` otherwise).
    pub fn of(policy: Option<&str>, image: &str) -> PullPolicy {
        match policy {
            Some("Always") => PullPolicy::Always,
            Some("Never") => PullPolicy::Never,
            Some("IfNotPresent") => PullPolicy::IfNotPresent,
            _ => {
                let has_digest = image.contains('@');
                let last = image.rsplit('/').next().unwrap_or(image);
                let tag = last.split_once(':').map(|(_, t)| t);
                if !has_digest && matches!(tag, None | Some("latest")) {
                    PullPolicy::Always
                } else {
                    PullPolicy::IfNotPresent
                }
            }
        }
    }
}

/// What went wrong in a provider, by what the lifecycle does about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderErrorKind {
    /// The image could not be pulled or prepared (`ErrImagePull`, then
    /// `ImagePullBackOff`).
    ImagePull,
    /// The image is not there and `imagePullPolicy` is `Never`
    /// (`ErrImageNeverPull`, kept through the retries: no pull backs off).
    ImageNeverPull,
    /// The container's configuration cannot be run
    /// (`CreateContainerConfigError`).
    Config,
    /// The container could not be started (`ContainerCannotRun`, restarted
    /// with backoff).
    CannotRun,
    /// The provider has no such container.
    NotFound,
    /// It did not finish within the time given.
    Timeout,
    /// The provider cannot do what was asked (exec into a WebAssembly
    /// module, say); the message says why.
    Unsupported,
    /// Anything else.
    Other,
}

/// An error from a provider.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ProviderError {
    /// What it means for the lifecycle.
    pub kind: ProviderErrorKind,
    /// What happened, for the container status and the log.
    pub message: String,
}

impl ProviderError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ProviderErrorKind, message: impl Into<String>) -> Self {
        ProviderError { kind, message: message.into() }
    }
}

/// What a command run in a container to its end printed and returned
/// (exec probes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecOutput {
    /// Its exit code.
    pub exit_code: i32,
    /// What it wrote to stdout (maybe cut short).
    pub stdout: Vec<u8>,
    /// What it wrote to stderr (maybe cut short).
    pub stderr: Vec<u8>,
}

/// A container's resource use as its runtime measures it (the kubelet's
/// `/stats/summary` and `/metrics/resource`). Fields a runtime cannot
/// measure are `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerStats {
    /// CPU time used since the container started, in nanoseconds.
    pub cpu_usage_core_nanoseconds: Option<u64>,
    /// Memory in use that cannot be reclaimed (the working set), in bytes.
    pub memory_working_set_bytes: Option<u64>,
    /// All memory in use, in bytes.
    pub memory_usage_bytes: Option<u64>,
    /// Anonymous memory (RSS), in bytes.
    pub memory_rss_bytes: Option<u64>,
    /// Page faults, minor and major, since the container started.
    pub memory_page_faults: Option<u64>,
    /// Major page faults (those that read from disk).
    pub memory_major_page_faults: Option<u64>,
    /// Bytes the container's writable layer takes on disk.
    pub fs_used_bytes: Option<u64>,
}

/// A pod's own figures as its runtime measures them (`/metrics/cadvisor`'s
/// pod-level series): its cgroup as a whole and its network namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodStats {
    /// The pod's cgroup, as cAdvisor names it (`/kubepods/burstable/pod<uid>`);
    /// `None` when the pod has none of its own.
    pub cgroup: Option<String>,
    /// CPU time the pod's cgroup used, in nanoseconds.
    pub cpu_usage_core_nanoseconds: Option<u64>,
    /// Its working set (usage less inactive file pages), in bytes.
    pub memory_working_set_bytes: Option<u64>,
    /// All memory charged to it, in bytes.
    pub memory_usage_bytes: Option<u64>,
    /// Its anonymous memory, in bytes.
    pub memory_rss_bytes: Option<u64>,
    /// The interfaces of the pod's network namespace (none when the pod
    /// uses the node's network or has none to measure).
    pub network: Vec<InterfaceStats>,
}

/// One network interface's counters, as `/proc/net/dev` gives them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InterfaceStats {
    /// The interface's name (`eth0`).
    pub name: String,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Packets received.
    pub rx_packets: u64,
    /// Receive errors.
    pub rx_errors: u64,
    /// Packets dropped while receiving.
    pub rx_dropped: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Packets sent.
    pub tx_packets: u64,
    /// Transmit errors.
    pub tx_errors: u64,
    /// Packets dropped while sending.
    pub tx_dropped: u64,
}

impl InterfaceStats {
    /// The interfaces in a `/proc/<pid>/net/dev` table, loopback left out
    /// (as cAdvisor leaves it out).
    pub fn parse_net_dev(table: &str) -> Vec<InterfaceStats> {
        table
            .lines()
            .skip(2)
            .filter_map(|line| {
                let (name, counters) = line.split_once(':')?;
                let name = name.trim();
                let v: Vec<u64> = counters.split_whitespace().filter_map(|f| f.parse().ok()).collect();
                (name != "lo" && v.len() >= 12).then(|| InterfaceStats {
                    name: name.to_owned(),
                    rx_bytes: v[0],
                    rx_packets: v[1],
                    rx_errors: v[2],
                    rx_dropped: v[3],
                    tx_bytes: v[8],
                    tx_packets: v[9],
                    tx_errors: v[10],
                    tx_dropped: v[11],
                })
            })
            .collect()
    }
}

/// A streaming session asked of a provider: `kubectl exec` or `attach`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamRequest {
    /// The command to run (`exec`; empty for `attach`).
    pub command: Vec<String>,
    /// Whether the session has a terminal.
    pub tty: bool,
    /// Whether the client sends stdin.
    pub stdin: bool,
    /// Whether the client reads stdout.
    pub stdout: bool,
    /// Whether the client reads stderr (never with a terminal).
    pub stderr: bool,
}

/// Where a streaming session is served.
pub enum StreamingEndpoint {
    /// The runtime's own streaming server: the client is sent there (the
    /// URL a CRI runtime answers `Exec`, `Attach` and `PortForward` with).
    Url(String),
    /// The provider runs the session itself; the node joins the client's
    /// streams to it (SPDY, as the API server proxies them).
    Session(Box<dyn StreamSession>),
}

impl std::fmt::Debug for StreamingEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamingEndpoint::Url(url) => f.debug_tuple("Url").field(url).finish(),
            StreamingEndpoint::Session(_) => f.write_str("Session(..)"),
        }
    }
}

/// The standard streams of a session the provider runs
/// ([`StreamingEndpoint::Session`]); each is there if the client asked for
/// it. `stdin` ends when the client closes it; the provider closes
/// `stdout` and `stderr` (by dropping them) when the session's output ends.
#[derive(Debug, Default)]
pub struct SessionStreams {
    /// What the client types.
    pub stdin: Option<tokio::io::DuplexStream>,
    /// What the client reads as stdout.
    pub stdout: Option<tokio::io::DuplexStream>,
    /// What the client reads as stderr.
    pub stderr: Option<tokio::io::DuplexStream>,
}

/// An exec or attach the provider runs itself.
#[async_trait]
pub trait StreamSession: Send {
    /// Runs the session with `streams` to its end; the exit code of the
    /// command (exec) or of the container (attach; 0 when the client left
    /// first).
    async fn run(self: Box<Self>, streams: SessionStreams) -> Result<i32, ProviderError>;
}

/// Registry credentials from a pod's `imagePullSecrets`, in the pod's
/// order: each a docker config (`{"auths": {...}}`, what a
/// `kubernetes.io/dockerconfigjson` Secret holds; a legacy `.dockercfg` is
/// given in the same shape). `Debug` shows how many, never their content.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PullSecrets(pub Vec<Vec<u8>>);

impl std::fmt::Debug for PullSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PullSecrets({} docker configs)", self.0.len())
    }
}

/// What runs containers for the node.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    /// Makes the container's image ready to run.
    async fn prepare_image(&self, pod: &Pod, container: &Container) -> Result<PreparedImage, ProviderError>;

    /// Makes the image ready with the pod's registry credentials (cluster
    /// mode reads its `imagePullSecrets`); by default the credentials are
    /// not used and [`Provider::prepare_image`] is called.
    async fn prepare_image_with_secrets(
        &self,
        pod: &Pod,
        container: &Container,
        secrets: &PullSecrets,
    ) -> Result<PreparedImage, ProviderError> {
        let _ = secrets;
        self.prepare_image(pod, container).await
    }

    /// Starts a container; returns once it runs.
    async fn start_container(&self, launch: &ContainerLaunch) -> Result<ContainerId, ProviderError>;

    /// Waits until the container ends.
    async fn wait_container(&self, id: &ContainerId) -> Result<ContainerExit, ProviderError>;

    /// Stops the container: asks it to end, and kills it after `grace`.
    async fn stop_container(&self, id: &ContainerId, grace: Duration) -> Result<(), ProviderError>;

    /// The containers that still run (called once when the node starts, to
    /// adopt what an earlier run of the node started).
    async fn running_containers(&self) -> Result<Vec<RunningContainer>, ProviderError>;

    /// The containers running now, with their pods' UIDs: the node's
    /// relist (every 10 s, the kubelet's PLEG series and running counts).
    /// One cheap listing without side effects (unlike
    /// [`running_containers`](Provider::running_containers)). By default:
    /// unsupported, and the node has no relist series.
    async fn list_running(&self) -> Result<Vec<(String, ContainerId)>, ProviderError> {
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider does not list its running containers"))
    }

    /// When the container `id` started, as the runtime recorded it: asked
    /// once after a start, so that the status reports the runtime's time
    /// (as the kubelet does) and a node that adopts the container after a
    /// restart reports the same. By default: unsupported, and the node's
    /// clock when the start returned is reported.
    async fn started_at(&self, id: &ContainerId) -> Result<Timestamp, ProviderError> {
        let _ = id;
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider does not say when a container started"))
    }

    /// Runs `command` in the running container `id` to its end, within
    /// `timeout` (exec probes); a command still running then is an error of
    /// kind [`ProviderErrorKind::Timeout`]. By default: unsupported.
    async fn exec_sync(
        &self,
        id: &ContainerId,
        command: &[String],
        timeout: Duration,
    ) -> Result<ExecOutput, ProviderError> {
        let _ = (id, command, timeout);
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider cannot run commands in its containers"))
    }

    /// Starts an interactive command in container `id` (`kubectl exec`).
    /// By default: unsupported.
    async fn exec(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        let _ = (id, request);
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider does not support exec"))
    }

    /// Joins container `id`'s stdio (`kubectl attach`). By default:
    /// unsupported.
    async fn attach(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        let _ = (id, request);
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider does not support attach"))
    }

    /// Forwards `ports` of pod `pod_uid`'s network (`kubectl
    /// port-forward`). By default: unsupported.
    async fn port_forward(&self, pod_uid: &str, ports: &[u16]) -> Result<StreamingEndpoint, ProviderError> {
        let _ = (pod_uid, ports);
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider does not support port-forward"))
    }

    /// The container's CPU and memory use (the kubelet API's stats and
    /// resource metrics); by default the provider measures nothing.
    async fn container_stats(&self, id: &ContainerId) -> Result<ContainerStats, ProviderError> {
        let _ = id;
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider does not measure its containers"))
    }

    /// Pod `pod`'s own figures: its cgroup as a whole and its network
    /// (`/metrics/cadvisor`). By default: unsupported, and the node sums
    /// the pod's containers instead.
    async fn pod_stats(&self, pod: &Pod) -> Result<PodStats, ProviderError> {
        let _ = pod;
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider has no pod-level stats"))
    }

    /// In-place resize: gives the running container `id` the resources of
    /// `container` (its new allocation) without restarting it; `pod` is the
    /// pod with its new allocation. By default: unsupported (the resize
    /// stays in progress with that error in the pod's status).
    async fn update_container_resources(
        &self,
        pod: &Pod,
        id: &ContainerId,
        container: &Container,
    ) -> Result<(), ProviderError> {
        let _ = (pod, id, container);
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider cannot resize a running container"))
    }

    /// In-place resize: sets the pod-level limits (its cgroup, a budget)
    /// from `pod`'s containers. The node calls it before the containers
    /// are updated with the larger of the old and new figures, and after
    /// with the new ones, so neither level is ever below the other. By
    /// default nothing is kept at pod level.
    async fn update_pod_resources(&self, pod: &Pod) -> Result<(), ProviderError> {
        let _ = pod;
        Ok(())
    }

    /// The pod's own IPs when the provider gives it a network of its own (a
    /// CRI sandbox's); empty when the pod uses the node's (then its
    /// `podIPs` are the node's).
    async fn pod_ips(&self, pod_uid: &str) -> Vec<std::net::IpAddr> {
        let _ = pod_uid;
        Vec::new()
    }

    /// Gives the pod its network before its first container starts (a CRI
    /// sandbox), so that its IPs are known to the containers' env
    /// (`status.podIP`) and `/etc/hosts`; returns them. `log_directory` is
    /// where the pod's container logs go. By default nothing is prepared
    /// and the pod uses the node's network.
    async fn prepare_pod(
        &self,
        pod: &Pod,
        log_directory: &std::path::Path,
    ) -> Result<Vec<std::net::IpAddr>, ProviderError> {
        let _ = (pod, log_directory);
        Ok(Vec::new())
    }

    /// Whether a mount's host path may be a single file (bind-mounted onto a
    /// file in the container) for `pod`: then the node gives its containers
    /// the kubelet's `/etc/hosts` and a termination-message file. A
    /// provider that mounts directories only (WASI preopens) says no.
    fn mounts_files(&self, pod: &Pod) -> bool {
        let _ = pod;
        false
    }

    /// Whether the runtime that runs `pod` applies CDI devices itself
    /// ([`ContainerRunOptions::cdi_devices`]: a CRI runtime with CDI on).
    /// When it does not (the default), the node reads the CDI specs and
    /// adds their env, device nodes and mounts to the run options. A
    /// provider that wraps others answers for the one that runs `pod`.
    fn reads_cdi(&self, pod: &Pod) -> bool {
        let _ = pod;
        false
    }

    /// The runtime's name and version as the Node reports them
    /// (`status.nodeInfo.containerRuntimeVersion`: `containerd://1.6.20`);
    /// empty: Rustlet's own.
    fn runtime_version(&self) -> String {
        String::new()
    }

    /// Whether the runtime honours `supplementalGroupsPolicy: Strict`
    /// (only the pod's groups, none from the image's `/etc/group`): the
    /// Node's `status.features.supplementalGroupsPolicy`. A pod asking for
    /// `Strict` is refused at admission where this is false, as the kubelet
    /// refuses it.
    fn supports_strict_supplemental_groups(&self) -> bool {
        false
    }

    /// Whether the pod network `pod` would join is ready: a receiver whose
    /// value is `None` while it is, and the runtime's reason while it is not
    /// (upstream's `container runtime network not ready: NetworkReady=false
    /// reason:... message:...`). A pod that needs the pod network waits for
    /// `None` before its sandbox is made, as the kubelet holds such pods
    /// while the runtime's network is not ready; host-network pods do not
    /// wait (the network plugin's own pods are among them). `None`: the
    /// provider has no such condition (the default).
    fn network_readiness(&self, pod: &Pod) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        let _ = pod;
        None
    }

    /// Forgets what the provider keeps for a removed pod (after its
    /// containers are stopped).
    async fn remove_pod(&self, pod_uid: &str) -> Result<(), ProviderError> {
        let _ = pod_uid;
        Ok(())
    }

    /// The runtime that runs `pod`'s containers, as the scheme of their IDs
    /// in the pod's status (`containerd://<id>`, as upstream); empty: IDs
    /// are shown bare.
    fn runtime_type(&self, pod: &Pod) -> String {
        let _ = pod;
        String::new()
    }

    /// Labels the node carries because of this provider (they override the
    /// node's own, e.g. `kubernetes.io/arch`).
    fn node_labels(&self) -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    /// Taints the node carries because of this provider, so that only pods
    /// that tolerate them are scheduled to it.
    fn node_taints(&self) -> Vec<k8s_openapi::api::core::v1::Taint> {
        Vec::new()
    }

    /// Memory, in bytes, that running `pod` costs beyond what its
    /// containers request: admission adds it to the pod's memory request.
    /// The WebAssembly provider runs modules inside the node, so each
    /// instance's stack and bookkeeping count here. (Unlike a
    /// RuntimeClass's `overhead`, the scheduler does not see it.)
    fn pod_overhead(&self, pod: &Pod) -> u128 {
        let _ = pod;
        0
    }

    /// The most pods this provider can run in the node's process, from the
    /// process's own limits (memory mappings, address space), and why; the
    /// node admits no more than that, whatever `--max-pods` says.
    fn pod_ceiling(&self) -> Option<(usize, String)> {
        None
    }

    /// Removes exited containers beyond the newest `keep` of each container
    /// of each pod, with their log files (the newest stays for `kubectl
    /// logs --previous`), as the kubelet's container garbage collection.
    async fn collect_containers(&self, keep: usize) -> Result<ContainerGcReport, ProviderError> {
        let _ = keep;
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider keeps no exited containers"))
    }

    /// Removes images no container uses, least recently used first, when
    /// the image file system is fuller than the policy's high threshold
    /// (down to its low one), or all of them when `all_unused` (the node is
    /// short of disk).
    async fn collect_images(&self, policy: &ImageGcPolicy, all_unused: bool) -> Result<ImageGcReport, ProviderError> {
        let _ = (policy, all_unused);
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider does not collect images"))
    }

    /// Makes the container write its log to its log path again (the node
    /// renamed the file to rotate it): CRI's `ReopenContainerLog`.
    async fn reopen_container_log(&self, id: &ContainerId) -> Result<(), ProviderError> {
        let _ = id;
        Err(ProviderError::new(ProviderErrorKind::Unsupported, "this provider does not reopen container logs"))
    }

    /// A path on the file system that holds the provider's images (the
    /// eviction manager's `imagefs`), if it has one of its own; `None`:
    /// the node's root dir holds them.
    async fn image_fs_path(&self) -> Option<std::path::PathBuf> {
        None
    }

    /// The process of the container runtime the provider talks to, if it
    /// is one (the Summary API's `runtime` system container).
    async fn runtime_process(&self) -> Option<u32> {
        None
    }
}

/// What a container garbage collection removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerGcReport {
    /// The containers removed.
    pub removed: Vec<ContainerId>,
}

/// When images are collected (the kubelet's image GC policy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageGcPolicy {
    /// Collect once the image file system is this full, in percent
    /// (`--image-gc-high-threshold`, 85; 100 turns it off).
    pub high_threshold_percent: u8,
    /// … down to this (`--image-gc-low-threshold`, 80).
    pub low_threshold_percent: u8,
    /// Images the node first saw more recently than this are kept
    /// (`--minimum-image-ttl-duration`, 2 min).
    pub min_age: std::time::Duration,
    /// Images never removed besides those the runtime pins (the sandbox
    /// image: `--pod-infra-container-image`).
    pub pinned: Vec<String>,
}

impl Default for ImageGcPolicy {
    fn default() -> Self {
        ImageGcPolicy {
            high_threshold_percent: 85,
            low_threshold_percent: 80,
            min_age: std::time::Duration::from_secs(120),
            pinned: Vec::new(),
        }
    }
}

/// What an image garbage collection did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageGcReport {
    /// Bytes it set out to free (0: the file system was below the high
    /// threshold).
    pub wanted: u64,
    /// Bytes the removed images held.
    pub freed: u64,
    /// The images removed (their IDs).
    pub removed: Vec<String>,
}

/// One line of container output in the CRI log format:
/// `<RFC 3339 time> <stream> F <line>\n` (`stream` is `stdout` or `stderr`).
pub fn cri_log_line(stream: &str, line: &str) -> String {
    format!("{} {stream} F {line}\n", jiff::Timestamp::now())
}

/// The text of a CRI-format log: each entry's message, partial entries
/// (`P`) joined to the next; a line that is not CRI-formatted is kept as is.
pub fn decode_cri_log(raw: &str) -> Vec<String> {
    let mut decoder = CriLogDecoder::default();
    let mut lines = decoder.feed(raw.as_bytes());
    lines.extend(decoder.finish());
    lines
}

/// A log line with the time the runtime stamped on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// The CRI timestamp (RFC 3339 with nanoseconds), as written; empty
    /// for a line not in the CRI format.
    pub time: String,
    /// The line, with its newline.
    pub text: String,
}

/// Decodes a CRI-format log as it grows: `feed` takes whatever bytes were
/// appended and returns the lines completed by them; an entry not yet ended
/// by a newline, and partial (`P`) entries, wait for the rest.
#[derive(Debug, Default)]
pub struct CriLogDecoder {
    /// Raw bytes after the last newline seen (maybe part of a character).
    raw: Vec<u8>,
    /// Messages of `P` entries waiting for their `F`, and the first one's time.
    pending: Option<LogEntry>,
}

impl CriLogDecoder {
    /// Takes appended bytes; returns the lines they complete.
    pub fn feed(&mut self, appended: &[u8]) -> Vec<String> {
        self.feed_entries(appended).into_iter().map(|e| e.text).collect()
    }

    /// The log ended: whatever is left, as the last line.
    pub fn finish(&mut self) -> Vec<String> {
        self.finish_entries().into_iter().map(|e| e.text).collect()
    }

    /// [`CriLogDecoder::feed`], with each line's time.
    pub fn feed_entries(&mut self, appended: &[u8]) -> Vec<LogEntry> {
        self.raw.extend_from_slice(appended);
        let Some(end) = self.raw.iter().rposition(|&b| b == b'\n') else { return Vec::new() };
        let complete: Vec<u8> = self.raw.drain(..=end).collect();
        let mut lines = Vec::new();
        for entry in String::from_utf8_lossy(&complete).lines() {
            self.entry(entry, &mut lines);
        }
        lines
    }

    /// [`CriLogDecoder::finish`], with each line's time.
    pub fn finish_entries(&mut self) -> Vec<LogEntry> {
        let mut lines = Vec::new();
        let rest = std::mem::take(&mut self.raw);
        if !rest.is_empty() {
            self.entry(&String::from_utf8_lossy(&rest), &mut lines);
        }
        if let Some(pending) = self.pending.take() {
            lines.push(pending);
        }
        lines
    }

    fn entry(&mut self, entry: &str, lines: &mut Vec<LogEntry>) {
        let mut fields = entry.splitn(4, ' ');
        let (time, _stream, tag, message) = (fields.next(), fields.next(), fields.next(), fields.next());
        let time = time.unwrap_or_default();
        let fresh = || LogEntry { time: time.to_owned(), text: String::new() };
        match (tag, message) {
            (Some("P"), Some(message)) => self.pending.get_or_insert_with(fresh).text.push_str(message),
            (Some("F"), message) => {
                let mut line = self.pending.take().unwrap_or_else(fresh);
                line.text.push_str(message.unwrap_or_default());
                line.text.push('\n');
                lines.push(line);
            }
            _ => lines.push(LogEntry { time: String::new(), text: format!("{entry}\n") }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cri_logs_round_trip() {
        let raw = format!(
            "{}{}2024-01-01T00:00:00Z stdout P part-\n2024-01-01T00:00:00Z stdout F two\nnot cri\n",
            cri_log_line("stdout", "hello world"),
            cri_log_line("stderr", "")
        );
        assert_eq!(decode_cri_log(&raw), ["hello world\n", "\n", "part-two\n", "not cri\n"]);
    }

    #[test]
    fn cri_logs_decode_as_they_grow() {
        let raw = format!(
            "{}2024-01-01T00:00:00Z stdout P part-\n2024-01-01T00:00:00Z stdout F two\nlast",
            cri_log_line("stdout", "oné")
        );
        // Fed one byte at a time, each line comes out as it is completed.
        let mut decoder = CriLogDecoder::default();
        let mut seen = Vec::new();
        for (i, byte) in raw.bytes().enumerate() {
            for line in decoder.feed(&[byte]) {
                seen.push((i, line));
            }
        }
        let first_end = raw.find('\n').expect("newline");
        // A character split across two reads is kept whole.
        assert_eq!(seen[0], (first_end, "oné\n".to_owned()));
        assert_eq!(seen[1].1, "part-two\n");
        assert_eq!(seen.len(), 2);
        assert_eq!(decoder.finish(), ["last\n"]);
    }
}
