//! Rustlet's CRI provider: Linux containers run by a container runtime
//! (containerd) that serves CRI v1 (`runtime.v1`) on a Unix socket, as the
//! kubelet runs them.
//!
//! Per pod, a sandbox: `RunPodSandbox` with the pod's metadata, log
//! directory, host namespaces and port mappings, and upstream's labels
//! (`io.kubernetes.pod.name`, `.namespace`, `.uid`); `StopPodSandbox` and
//! `RemovePodSandbox` when the pod is removed. Per container:
//! `CreateContainer` (command, args, env, volume and device mounts, device
//! nodes, CDI devices, annotations, resources from limits and requests, the
//! log path in the kubelet's layout) and `StartContainer`; `StopContainer`
//! with the grace period. Images: `ImageStatus`, then `PullImage` as
//! `imagePullPolicy` says.
//!
//! Exits are seen by one relist for all waiters: every
//! [`CriConfig::relist_interval`] while anything waits, one `ListContainers`
//! of the running containers, then `ContainerStatus` only for those no
//! longer running (containerd 1.6 has no `GetContainerEvents`).
//!
//! After a node restart, [`Provider::running_containers`] lists the running
//! containers by their labels and they are adopted, sandboxes included.
//!
//! Security contexts follow the kubelet's derivation (the `security` module);
//! pull secrets become `PullImage`'s credentials (the `auth` module).
//!
//! With [`CriConfig::pod_cgroups`] each sandbox's `cgroup_parent` is its
//! pod's group in the node's `kubepods` hierarchy, made with the pod's
//! limits before the sandbox and removed after it. Logs are reopened for
//! rotation (`ReopenContainerLog`); exited containers and unused images
//! are collected as the kubelet collects them (the `gc` module).
//!
//! Each sandbox gets the pod's DNS settings (see [`dns`]); `ExecSync` runs
//! exec probes; `Exec`, `Attach` and `PortForward` answer the runtime's
//! streaming URL, for the kubelet API to serve.

#![deny(missing_docs)]

mod auth;
pub mod dns;
mod gc;
mod security;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::jiff::Timestamp;
use kubelet_api::cri::v1 as cri;
use kubelet_api::cri::v1::image_service_client::ImageServiceClient;
use kubelet_api::cri::v1::runtime_service_client::RuntimeServiceClient;
use kubelet_api::uds::{UdsChannel, dial, socket_path_of};
use kubelet_provider::{
    ContainerExit, ContainerId, ContainerLaunch, ContainerStats, ExecOutput, MountPropagation, PreparedImage, Provider,
    ProviderError, ProviderErrorKind, PullPolicy, PullSecrets, RunningContainer, StreamRequest, StreamingEndpoint,
};
use kubelet_support::cgroups::PodCgroups;
use kubelet_support::retry::RetryBackoff;
use tokio::sync::watch;

/// The label a sandbox and its containers carry with the pod's name.
pub(crate) const POD_NAME_LABEL: &str = "io.kubernetes.pod.name";
/// … with the pod's namespace.
pub(crate) const POD_NAMESPACE_LABEL: &str = "io.kubernetes.pod.namespace";
/// … with the pod's UID.
pub(crate) const POD_UID_LABEL: &str = "io.kubernetes.pod.uid";
/// The label a container carries with its name.
pub(crate) const CONTAINER_NAME_LABEL: &str = "io.kubernetes.container.name";
/// The annotation a container carries with its restart count.
pub(crate) const RESTART_COUNT_ANNOTATION: &str = "io.kubernetes.container.restartCount";

/// How the provider reaches the runtime.
#[derive(Clone, Debug)]
pub struct CriConfig {
    /// The runtime's socket (`unix:///run/containerd/containerd.sock`, the
    /// kubelet's `--container-runtime-endpoint`).
    pub endpoint: String,
    /// The deadline of one call (upstream's `--runtime-request-timeout`:
    /// 2 min); a pull gets it too.
    pub call_timeout: Duration,
    /// How often the running containers are listed while any container is
    /// waited on.
    pub relist_interval: Duration,
    /// The node's DNS settings, for each pod's `resolv.conf`.
    pub dns: dns::DnsSettings,
    /// The node's registry credentials (a docker `config.json`, read at
    /// each pull; the binary's is `<root-dir>/config.json`), tried after
    /// the pod's pull secrets, as the kubelet's keyring falls back to the
    /// node's docker config. `None`, or a missing file: none.
    pub docker_config: Option<std::path::PathBuf>,
    /// The node's memory capacity in bytes, for Burstable containers' OOM
    /// score adjustment (`None`: the machine's `MemTotal`).
    pub memory_capacity: Option<u64>,
    /// The node's pod cgroups: each sandbox's `cgroup_parent` is its pod's
    /// group, made with the pod's limits before the sandbox and removed
    /// after it. `None`: the runtime's default place, no pod-level limits.
    pub pod_cgroups: Option<Arc<PodCgroups>>,
}

impl CriConfig {
    /// Upstream's deadline; a relist every 100 ms.
    pub fn new(endpoint: impl Into<String>) -> CriConfig {
        CriConfig {
            endpoint: endpoint.into(),
            call_timeout: Duration::from_secs(120),
            relist_interval: Duration::from_millis(100),
            dns: dns::DnsSettings::default(),
            docker_config: None,
            memory_capacity: None,
            pod_cgroups: None,
        }
    }
}

/// How containers' OOM score adjustments are set: as the kubelet computes
/// them ([`kubelet_provider::qos::oom_score_adj`]), raised to what the host
/// allows.
#[derive(Clone, Copy, Debug)]
struct OomPolicy {
    /// The node's memory capacity in bytes.
    capacity: u64,
    /// The lowest adjustment the host lets a process take.
    floor: i64,
}

impl OomPolicy {
    /// The policy for `config`: its memory capacity (else the machine's),
    /// and the host's floor, found by asking a shell to lower its own
    /// adjustment (some hosts, such as some VMs and user namespaces,
    /// refuse negative values even to root). Says so once when it is
    /// raised.
    fn new(config: &CriConfig) -> OomPolicy {
        let capacity = config.memory_capacity.or_else(mem_total).unwrap_or(u64::MAX);
        let lowered = std::process::Command::new("/bin/sh")
            .args(["-c", "echo -1 > /proc/self/oom_score_adj"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        let floor = if lowered { -1000 } else { 0 };
        if !lowered {
            tracing::warn!(
                "this host refuses negative oom_score_adj values: Guaranteed and node-critical containers get 0 \
                 instead of the kubelet's -997 (Burstable and BestEffort ones are unaffected)"
            );
        }
        OomPolicy { capacity, floor }
    }

    /// The adjustment of `container` of `pod`.
    fn adjustment(&self, pod: &Pod, container: &Container) -> i64 {
        kubelet_provider::qos::oom_score_adj(pod, container, self.capacity).max(self.floor)
    }
}

/// The machine's memory (`MemTotal` of `/proc/meminfo`), in bytes.
fn mem_total() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
}

/// Containers through CRI. Cheap to clone.
#[derive(Clone)]
pub struct CriProvider {
    inner: Arc<Inner>,
}

struct Inner {
    config: CriConfig,
    oom: OomPolicy,
    channel: tokio::sync::Mutex<Option<UdsChannel>>,
    /// Pod UID → its sandbox (created once per pod; a lock per pod).
    sandboxes: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<String>>>>>,
    /// Sandbox ID → the process holding its network namespace (from the
    /// verbose `PodSandboxStatus`), for the pod's network stats.
    sandbox_pids: Mutex<HashMap<String, u32>>,
    /// Containers being waited on; the relist bumps the generation.
    waited: Mutex<HashSet<String>>,
    /// The ids that ran at the last relist and its count.
    relisted: watch::Sender<(u64, HashSet<String>)>,
    relisting: Mutex<bool>,
    /// The runtime's name from `Version` (`containerd`), once asked.
    runtime_name: Mutex<Option<String>>,
    /// `<name>://<version>` from `Version`, once asked.
    runtime_version: Mutex<Option<String>>,
    /// When each image was first seen and last seen used (image GC).
    images: Mutex<gc::ImageRecords>,
    /// Whether the runtime applies CDI devices (containerd 1.7+ with
    /// `enable_cdi`, in `Status` verbose's `config.enableCDI`); learnt
    /// with the runtime's name.
    reads_cdi: std::sync::atomic::AtomicBool,
    /// Whether the runtime honours `supplementalGroupsPolicy: Strict`
    /// (`Status`'s `features`, CRI 1.31+; containerd 2.0 says so, 1.6 and
    /// 1.7 say nothing); learnt at each status check.
    strict_supplemental_groups: std::sync::atomic::AtomicBool,
    /// The runtime's `NetworkReady` condition as last read: `None` while it
    /// holds (or before it was first read), else why not.
    network: watch::Sender<Option<String>>,
}

impl std::fmt::Debug for CriProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CriProvider").field("endpoint", &self.inner.config.endpoint).finish_non_exhaustive()
    }
}

fn other(what: &str, status: &tonic::Status) -> ProviderError {
    ProviderError::new(ProviderErrorKind::Other, format!("{what}: {}", describe(status)))
}

fn describe(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

/// Why the container runtime is not ready, in upstream's words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {detail}")]
pub(crate) struct RuntimeNotReady {
    /// `container runtime is down` or `container runtime network not ready`.
    pub what: &'static str,
    /// What the runtime said (or why it could not be asked).
    pub detail: String,
}

impl CriProvider {
    /// A provider for the runtime at `config.endpoint`; it connects on
    /// first use (and again after the runtime restarts).
    pub fn new(config: CriConfig) -> CriProvider {
        CriProvider {
            inner: Arc::new(Inner {
                oom: OomPolicy::new(&config),
                config,
                channel: tokio::sync::Mutex::new(None),
                sandboxes: Mutex::default(),
                sandbox_pids: Mutex::default(),
                waited: Mutex::default(),
                relisted: watch::channel((0, HashSet::new())).0,
                relisting: Mutex::new(false),
                runtime_name: Mutex::new(None),
                runtime_version: Mutex::new(None),
                images: Mutex::default(),
                reads_cdi: std::sync::atomic::AtomicBool::new(false),
                strict_supplemental_groups: std::sync::atomic::AtomicBool::new(false),
                network: watch::channel(None).0,
            }),
        }
    }

    /// The runtime's name and version (`Version`): whether it answers.
    pub async fn version(&self) -> Result<(String, String), ProviderError> {
        let mut runtime = self.runtime().await?;
        let answer = self
            .call(runtime.version(cri::VersionRequest { version: "v1".into() }))
            .await
            .map_err(|s| other("Version", &s))?;
        *self.inner.runtime_name.lock().unwrap_or_else(|p| p.into_inner()) = Some(answer.runtime_name.clone());
        *self.inner.runtime_version.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(format!("{}://{}", answer.runtime_name, answer.runtime_version));
        Ok((answer.runtime_name, answer.runtime_version))
    }

    /// The docker configs a pull tries, in order: the pod's pull secrets,
    /// then the node's `config.json`.
    fn credentials(&self, secrets: &PullSecrets) -> Vec<Vec<u8>> {
        let mut configs = secrets.0.clone();
        if let Some(path) = &self.inner.config.docker_config {
            match std::fs::read(path) {
                Ok(config) => configs.push(config),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "cannot read the node's registry credentials")
                }
            }
        }
        configs
    }

    /// Asks the runtime's name once (it is the scheme of container IDs in
    /// pod statuses).
    async fn learn_runtime_name(&self) {
        if self.inner.runtime_name.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
            return;
        }
        if let Err(error) = self.version().await {
            tracing::debug!(%error, "Version failed; container IDs are shown bare for now");
        }
        let reads_cdi = self.runtime_config().await.and_then(|c| c.get("enableCDI")?.as_bool()).unwrap_or(false);
        self.inner.reads_cdi.store(reads_cdi, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            reads_cdi,
            "the container runtime {} CDI specs",
            if reads_cdi { "applies" } else { "does not apply (the node resolves them)" }
        );
    }

    /// The runtime's own word on its health (`Status`): `Ok` when its
    /// `RuntimeReady` and `NetworkReady` conditions hold; else why not, in
    /// upstream's words (`container runtime is down`, `container runtime
    /// network not ready`).
    pub(crate) async fn runtime_status(&self) -> Result<(), RuntimeNotReady> {
        let down = |detail: String| RuntimeNotReady { what: "container runtime is down", detail };
        let mut runtime = self.runtime().await.map_err(|e| down(e.message))?;
        let status = self
            .call_within(Duration::from_secs(10), runtime.status(cri::StatusRequest { verbose: false }))
            .await
            .map_err(|s| down(describe(&s)))?;
        let strict = status.features.is_some_and(|f| f.supplemental_groups_policy);
        let before = self.inner.strict_supplemental_groups.swap(strict, std::sync::atomic::Ordering::Relaxed);
        if before != strict {
            tracing::info!(supported = strict, "the runtime's support for supplementalGroupsPolicy: Strict");
        }
        let conditions = status.status.map(|s| s.conditions).unwrap_or_default();
        let condition = |kind: &str| conditions.iter().find(|c| c.r#type == kind);
        let network = match condition("NetworkReady") {
            Some(c) if c.status => None,
            Some(c) => Some(format!(
                "container runtime network not ready: NetworkReady=false reason:{} message:{}",
                c.reason, c.message
            )),
            None => Some("container runtime network not ready: the runtime reports no NetworkReady condition".into()),
        };
        self.inner.network.send_if_modified(|now| {
            if *now == network {
                return false;
            }
            match &network {
                None => tracing::info!("the pod network is ready: pods waiting for it go on"),
                Some(why) => tracing::warn!(%why, "the pod network is not ready: pods that need it wait"),
            }
            *now = network;
            true
        });
        for (kind, what) in
            [("RuntimeReady", "container runtime is down"), ("NetworkReady", "container runtime network not ready")]
        {
            match condition(kind) {
                Some(c) if c.status => {}
                Some(c) => {
                    let detail = format!("{kind}=false reason:{} message:{}", c.reason, c.message);
                    return Err(RuntimeNotReady { what, detail });
                }
                None => {
                    return Err(RuntimeNotReady { what, detail: format!("the runtime reports no {kind} condition") });
                }
            }
        }
        Ok(())
    }

    /// Checks [`CriProvider::runtime_status`] every `period` until
    /// `shutdown`, telling `reporter` (a `/healthz` check, so the Node's
    /// Ready condition follows it); changes are logged.
    pub fn watch_health(
        &self,
        reporter: kubelet_support::health::HealthReporter,
        period: Duration,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let provider = self.clone();
        // Not supervised here: returned to the embedder, which watches it (the binary: `runtime-health`).
        tokio::spawn(async move {
            let mut last: Option<Result<(), RuntimeNotReady>> = None;
            loop {
                let now = provider.runtime_status().await;
                if last.as_ref() != Some(&now) {
                    // The check first, then the log line: whoever reads the
                    // line finds the check already changed.
                    match &now {
                        Ok(()) => {
                            reporter.healthy();
                            tracing::info!(endpoint = %provider.inner.config.endpoint, "container runtime is up");
                        }
                        Err(reason) => {
                            reporter.failing(reason.to_string());
                            tracing::warn!(endpoint = %provider.inner.config.endpoint, %reason, "container runtime is not ready");
                        }
                    }
                    last = Some(now);
                }
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(period) => {}
                }
            }
        })
    }

    async fn channel(&self) -> Result<UdsChannel, ProviderError> {
        let mut channel = self.inner.channel.lock().await;
        if let Some(channel) = channel.as_ref() {
            return Ok(channel.clone());
        }
        let path = socket_path_of(&self.inner.config.endpoint);
        let dialed = dial(path, self.inner.config.call_timeout.min(Duration::from_secs(10))).await.map_err(|e| {
            ProviderError::new(ProviderErrorKind::Other, format!("container runtime {}: {e}", path.display()))
        })?;
        *channel = Some(dialed.clone());
        Ok(dialed)
    }

    async fn runtime(&self) -> Result<RuntimeServiceClient<UdsChannel>, ProviderError> {
        Ok(RuntimeServiceClient::new(self.channel().await?))
    }

    async fn images(&self) -> Result<ImageServiceClient<UdsChannel>, ProviderError> {
        Ok(ImageServiceClient::new(self.channel().await?))
    }

    /// One call under the deadline; a transport failure drops the
    /// connection so that the next call dials again.
    async fn call<T>(
        &self,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        self.call_within(self.inner.config.call_timeout, call).await
    }

    async fn call_within<T>(
        &self,
        timeout: Duration,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(answer)) => Ok(answer.into_inner()),
            Ok(Err(status)) => {
                if matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled) {
                    *self.inner.channel.lock().await = None;
                }
                Err(status)
            }
            Err(_) => Err(tonic::Status::deadline_exceeded(format!("no answer within {timeout:?}"))),
        }
    }

    /// The pod's sandbox, made from `config` on its first container.
    async fn sandbox(&self, pod: &Pod, config: &cri::PodSandboxConfig) -> Result<String, ProviderError> {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let entry = {
            let mut sandboxes = self.inner.sandboxes.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(sandboxes.entry(uid.to_owned()).or_default())
        };
        let mut sandbox = entry.lock().await;
        if let Some(id) = sandbox.as_ref() {
            return Ok(id.clone());
        }
        if let Some(cgroups) = &self.inner.config.pod_cgroups {
            cgroups.ensure_pod(pod).map_err(|e| {
                ProviderError::new(ProviderErrorKind::CannotRun, format!("cannot make the pod's cgroup: {e}"))
            })?;
        }
        let mut runtime = self.runtime().await?;
        let answer = self
            .call(runtime.run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            }))
            .await
            .map_err(|s| {
                ProviderError::new(ProviderErrorKind::CannotRun, format!("RunPodSandbox: {}", describe(&s)))
            })?;
        tracing::info!(pod.uid = %uid, sandbox = %answer.pod_sandbox_id, "pod sandbox running");
        *sandbox = Some(answer.pod_sandbox_id.clone());
        Ok(answer.pod_sandbox_id)
    }

    /// The process of pod `uid`'s sandbox (asked of the runtime once per
    /// sandbox), if it has one.
    async fn sandbox_pid(&self, uid: &str) -> Option<u32> {
        let entry = self.inner.sandboxes.lock().unwrap_or_else(|p| p.into_inner()).get(uid).cloned()?;
        let id = entry.try_lock().ok()?.clone()?;
        if let Some(pid) = self.inner.sandbox_pids.lock().unwrap_or_else(|p| p.into_inner()).get(&id) {
            return Some(*pid);
        }
        let mut runtime = self.runtime().await.ok()?;
        let request = cri::PodSandboxStatusRequest { pod_sandbox_id: id.clone(), verbose: true };
        let answer = self.call(runtime.pod_sandbox_status(request)).await.ok()?;
        let info: serde_json::Value = serde_json::from_str(answer.info.get("info")?).ok()?;
        let pid = u32::try_from(info.get("pid")?.as_u64()?).ok().filter(|p| *p > 0)?;
        let mut pids = self.inner.sandbox_pids.lock().unwrap_or_else(|p| p.into_inner());
        // Sandboxes of removed pods go when the map has grown.
        if pids.len() >= 1024 {
            pids.clear();
        }
        pids.insert(id, pid);
        Some(pid)
    }

    /// The sandbox config of `pod`, its logs under `log_directory`, in its
    /// pod cgroup if the node has them.
    fn sandbox_config(&self, pod: &Pod, log_directory: String) -> cri::PodSandboxConfig {
        let cgroup_parent = self.inner.config.pod_cgroups.as_ref().map(|c| c.cgroup_parent(pod)).unwrap_or_default();
        sandbox_config(pod, log_directory, cgroup_parent, &self.inner.config.dns)
    }

    /// Removes the pod cgroups an earlier run left of pods none of whose
    /// containers still run (`running`, at the node's start). A group that
    /// still holds something (a sandbox of a pod the node will adopt or
    /// remove) is kept: the kernel refuses to remove it.
    fn sweep_pod_cgroups(&self, running: &[RunningContainer]) {
        let Some(cgroups) = &self.inner.config.pod_cgroups else { return };
        let live: HashSet<&str> = running.iter().map(|c| c.pod_uid.as_str()).collect();
        for (uid, group) in cgroups.pod_groups() {
            if live.contains(uid.as_str()) {
                continue;
            }
            match cgroups.fs().remove(&group) {
                Ok(()) => tracing::info!(pod.uid = %uid, cgroup = %group, "removed the cgroup of a pod that is gone"),
                Err(error) => {
                    tracing::debug!(pod.uid = %uid, %error, "a pod cgroup from an earlier run still holds something")
                }
            }
        }
    }

    /// Starts the relist if it is not running: it lists the running
    /// containers while anything is waited on.
    fn ensure_relist(&self) {
        let mut relisting = self.inner.relisting.lock().unwrap_or_else(|p| p.into_inner());
        if *relisting {
            return;
        }
        *relisting = true;
        let provider = self.clone();
        // A failed listing is tried again after a jittered backoff from the
        // relist interval up to 2 s (jitter may double it), so that a
        // runtime that is down is not asked at every interval, and exits are
        // seen within seconds of its return.
        let mut failures = RetryBackoff::new(provider.inner.config.relist_interval, Duration::from_secs(2));
        // Not supervised: a relist while exits are waited for; it ends when none is, and the next wait starts another.
        tokio::spawn(async move {
            loop {
                if provider.inner.waited.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
                    let mut relisting = provider.inner.relisting.lock().unwrap_or_else(|p| p.into_inner());
                    if provider.inner.waited.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
                        *relisting = false;
                        return;
                    }
                }
                let wait = match provider.running_ids().await {
                    Ok(running) => {
                        provider.inner.relisted.send_modify(|(generation, ids)| {
                            *generation += 1;
                            *ids = running;
                        });
                        failures.reset();
                        provider.inner.config.relist_interval
                    }
                    Err(error) => {
                        let wait = failures.next_delay();
                        tracing::warn!(%error, retry_in = ?wait, "listing the running containers failed; retrying");
                        wait
                    }
                };
                tokio::time::sleep(wait).await;
            }
        });
    }

    async fn running_ids(&self) -> Result<HashSet<String>, ProviderError> {
        Ok(self.list_running_cri().await?.into_iter().map(|c| c.id).collect())
    }

    /// The containers the runtime runs (`ListContainers`, state running).
    async fn list_running_cri(&self) -> Result<Vec<cri::Container>, ProviderError> {
        let mut runtime = self.runtime().await?;
        let filter = cri::ContainerFilter {
            state: Some(cri::ContainerStateValue { state: cri::ContainerState::ContainerRunning as i32 }),
            ..Default::default()
        };
        let answer = self
            .call(runtime.list_containers(cri::ListContainersRequest { filter: Some(filter) }))
            .await
            .map_err(|s| other("ListContainers", &s))?;
        Ok(answer.containers)
    }

    async fn status(&self, id: &str) -> Result<cri::ContainerStatus, ProviderError> {
        let mut runtime = self.runtime().await?;
        let answer = self
            .call(runtime.container_status(cri::ContainerStatusRequest { container_id: id.to_owned(), verbose: false }))
            .await
            .map_err(|s| {
                let kind = if s.code() == tonic::Code::NotFound {
                    ProviderErrorKind::NotFound
                } else {
                    ProviderErrorKind::Other
                };
                ProviderError::new(kind, format!("ContainerStatus {id}: {}", describe(&s)))
            })?;
        answer.status.ok_or_else(|| ProviderError::new(ProviderErrorKind::Other, "ContainerStatus without a status"))
    }

    /// The user the image runs as (`ImageStatus`): its uid, else its user
    /// name, else root, as upstream reads it.
    async fn image_user(&self, image: &str) -> Result<security::ImageUser, ProviderError> {
        let mut images = self.images().await?;
        let answer = self
            .call(images.image_status(cri::ImageStatusRequest { image: Some(image_spec(image)), verbose: false }))
            .await
            .map_err(|s| other(&format!("ImageStatus {image}"), &s))?;
        let image = answer.image.unwrap_or_default();
        Ok(match (image.uid, image.username) {
            (Some(uid), _) => security::ImageUser::Uid(uid.value),
            (None, name) if !name.is_empty() => security::ImageUser::Name(name),
            _ => security::ImageUser::Uid(0),
        })
    }

    async fn image_id(&self, image: &str) -> Result<Option<String>, ProviderError> {
        let mut images = self.images().await?;
        let answer = self
            .call(images.image_status(cri::ImageStatusRequest { image: Some(image_spec(image)), verbose: false }))
            .await
            .map_err(|s| {
                ProviderError::new(ProviderErrorKind::ImagePull, format!("ImageStatus {image}: {}", describe(&s)))
            })?;
        Ok(answer.image.map(|i| i.id))
    }
}

fn image_spec(image: &str) -> cri::ImageSpec {
    cri::ImageSpec { image: image.to_owned(), ..Default::default() }
}

fn timestamp(nanos: i64) -> Timestamp {
    Timestamp::from_nanosecond(i128::from(nanos)).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// The pod's namespaces: the node's where the spec asks, else the pod's
/// own (PID per container unless `shareProcessNamespace`).
fn namespaces(pod: &Pod) -> cri::NamespaceOption {
    let spec = pod.spec.clone().unwrap_or_default();
    let mode = |host: Option<bool>, otherwise: cri::NamespaceMode| {
        if host.unwrap_or(false) { cri::NamespaceMode::Node as i32 } else { otherwise as i32 }
    };
    let pid = if spec.share_process_namespace.unwrap_or(false) {
        cri::NamespaceMode::Pod
    } else {
        cri::NamespaceMode::Container
    };
    cri::NamespaceOption {
        network: mode(spec.host_network, cri::NamespaceMode::Pod),
        pid: mode(spec.host_pid, pid),
        ipc: mode(spec.host_ipc, cri::NamespaceMode::Pod),
        ..Default::default()
    }
}

/// A container's namespaces: the pod's, except that an ephemeral container
/// with a target joins the target's process namespace (`kubectl debug
/// --target`).
fn container_namespaces(launch: &ContainerLaunch) -> cri::NamespaceOption {
    let mut options = namespaces(&launch.pod);
    if let Some(target) = &launch.target
        && options.pid == cri::NamespaceMode::Container as i32
    {
        options.pid = cri::NamespaceMode::Target as i32;
        options.target_id = target.0.clone();
    }
    options
}

/// The sandbox config of `pod`, its logs under `log_directory`, its
/// processes under `cgroup_parent` (empty: the runtime's default).
fn sandbox_config(
    pod: &Pod,
    log_directory: String,
    cgroup_parent: String,
    dns: &dns::DnsSettings,
) -> cri::PodSandboxConfig {
    let meta = &pod.metadata;
    let spec = pod.spec.clone().unwrap_or_default();
    let name = meta.name.clone().unwrap_or_default();
    let namespace = meta.namespace.clone().unwrap_or_else(|| "default".into());
    let uid = meta.uid.clone().unwrap_or_default();
    let host_network = spec.host_network.unwrap_or(false);
    let mut labels: HashMap<String, String> = meta.labels.clone().unwrap_or_default().into_iter().collect();
    labels.insert(POD_NAME_LABEL.into(), name.clone());
    labels.insert(POD_NAMESPACE_LABEL.into(), namespace.clone());
    labels.insert(POD_UID_LABEL.into(), uid.clone());
    let annotations: HashMap<String, String> = meta.annotations.clone().unwrap_or_default().into_iter().collect();
    let port_mappings = spec
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .filter(|p| p.host_port.is_some_and(|h| h > 0))
        .map(|p| cri::PortMapping {
            protocol: match p.protocol.as_deref() {
                Some("UDP") => cri::Protocol::Udp as i32,
                Some("SCTP") => cri::Protocol::Sctp as i32,
                _ => cri::Protocol::Tcp as i32,
            },
            container_port: p.container_port,
            host_port: p.host_port.unwrap_or_default(),
            host_ip: p.host_ip.clone().unwrap_or_default(),
        })
        .collect();
    let sysctls = spec
        .security_context
        .as_ref()
        .and_then(|s| s.sysctls.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|s| (s.name, s.value))
        .collect();
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata { name: name.clone(), uid, namespace, attempt: 0 }),
        // As upstream, a name too long for the kernel is cut to 63.
        hostname: if host_network { String::new() } else { kubelet_provider::hostname::pod_hostname(pod) },
        log_directory,
        dns_config: Some(dns::dns_config(pod, dns)),
        port_mappings,
        labels,
        annotations,
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent,
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(namespaces(pod)),
                privileged: security::has_privileged(pod),
                supplemental_groups_policy: security::supplemental_groups_policy(pod) as i32,
                ..Default::default()
            }),
            sysctls,
            ..Default::default()
        }),
    }
}

/// A quantity's value in milli-units (`cpu`) or units (`memory`), if it
/// parses.
fn milli(quantity: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> Option<i64> {
    kubelet_provider::quantity::parse_milli(&quantity.0).ok().and_then(|v| i64::try_from(v).ok())
}

fn units(quantity: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> Option<i64> {
    kubelet_provider::quantity::parse_units(&quantity.0).ok().and_then(|v| i64::try_from(v).ok())
}

/// Linux resources as upstream computes them: cpu shares from the request
/// (1024 per cpu, at least 2), quota over a 100 ms period from the limit,
/// the memory limit in bytes.
fn resources(container: &Container) -> cri::LinuxContainerResources {
    let requirements = container.resources.clone().unwrap_or_default();
    let limits = requirements.limits.unwrap_or_default();
    let requests = requirements.requests.unwrap_or_default();
    let cpu_request = requests.get("cpu").or(limits.get("cpu")).and_then(milli);
    let cpu_limit = limits.get("cpu").and_then(milli);
    let memory_limit = limits.get("memory").and_then(units);
    const PERIOD: i64 = 100_000;
    cri::LinuxContainerResources {
        cpu_shares: cpu_request.map_or(2, |m| (m * 1024 / 1000).max(2)),
        cpu_period: if cpu_limit.is_some() { PERIOD } else { 0 },
        cpu_quota: cpu_limit.map_or(0, |m| (m * PERIOD / 1000).max(1000)),
        memory_limit_in_bytes: memory_limit.unwrap_or(0),
        ..Default::default()
    }
}

fn container_config(launch: &ContainerLaunch, oom: &OomPolicy) -> cri::ContainerConfig {
    let pod = &launch.pod;
    let container = &launch.container;
    let options = &launch.run_options;
    let mut labels = HashMap::new();
    labels.insert(CONTAINER_NAME_LABEL.to_owned(), container.name.clone());
    labels.insert(POD_NAME_LABEL.to_owned(), pod.metadata.name.clone().unwrap_or_default());
    labels.insert(POD_NAMESPACE_LABEL.to_owned(), pod.metadata.namespace.clone().unwrap_or_else(|| "default".into()));
    labels.insert(POD_UID_LABEL.to_owned(), pod.metadata.uid.clone().unwrap_or_default());
    let mut annotations: HashMap<String, String> = options.annotations.clone().into_iter().collect();
    annotations.insert(RESTART_COUNT_ANNOTATION.to_owned(), launch.restart_count.to_string());
    let log_path = format!("{}/{}.log", container.name, launch.restart_count);
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata { name: container.name.clone(), attempt: launch.restart_count }),
        image: Some(image_spec(container.image.as_deref().unwrap_or_default())),
        command: options.command.clone(),
        args: options.args.clone(),
        working_dir: options.working_dir.clone().unwrap_or_default(),
        envs: options.env.iter().map(|e| cri::KeyValue { key: e.name.clone(), value: e.value.clone() }).collect(),
        mounts: options
            .mounts
            .iter()
            .map(|m| cri::Mount {
                container_path: m.container_path.clone(),
                host_path: m.host_path.display().to_string(),
                readonly: m.read_only,
                propagation: match m.propagation {
                    MountPropagation::Private => cri::MountPropagation::PropagationPrivate,
                    MountPropagation::HostToContainer => cri::MountPropagation::PropagationHostToContainer,
                    MountPropagation::Bidirectional => cri::MountPropagation::PropagationBidirectional,
                } as i32,
                ..Default::default()
            })
            .collect(),
        devices: options
            .devices
            .iter()
            .map(|d| cri::Device {
                container_path: d.container_path.clone(),
                host_path: d.host_path.clone(),
                permissions: d.permissions.clone(),
            })
            .collect(),
        labels,
        annotations,
        log_path,
        stdin: container.stdin.unwrap_or(false),
        stdin_once: container.stdin_once.unwrap_or(false),
        tty: container.tty.unwrap_or(false),
        linux: Some(cri::LinuxContainerConfig {
            resources: Some(cri::LinuxContainerResources {
                oom_score_adj: oom.adjustment(pod, container),
                ..resources(container)
            }),
            security_context: Some(security::security_context(pod, container, container_namespaces(launch))),
        }),
        cdi_devices: options.cdi_devices.iter().map(|name| cri::CdiDevice { name: name.clone() }).collect(),
    }
}

#[async_trait]
impl Provider for CriProvider {
    async fn prepare_image(&self, pod: &Pod, container: &Container) -> Result<PreparedImage, ProviderError> {
        self.prepare_image_with_secrets(pod, container, &PullSecrets::default()).await
    }

    async fn prepare_image_with_secrets(
        &self,
        _pod: &Pod,
        container: &Container,
        secrets: &PullSecrets,
    ) -> Result<PreparedImage, ProviderError> {
        let image = container.image.clone().unwrap_or_default();
        if image.is_empty() {
            return Err(ProviderError::new(ProviderErrorKind::Config, "the container has no image"));
        }
        let policy = PullPolicy::of(container.image_pull_policy.as_deref(), &image);
        if policy != PullPolicy::Always
            && let Some(id) = self.image_id(&image).await?
        {
            return Ok(PreparedImage { image_id: id });
        }
        if policy == PullPolicy::Never {
            return Err(ProviderError::new(
                ProviderErrorKind::ImageNeverPull,
                format!("Container image {image:?} is not present with pull policy of Never"),
            ));
        }
        tracing::info!(%image, "pulling image");
        let mut images = self.images().await?;
        let auth = auth::auth_for(&image, &self.credentials(secrets));
        let request = cri::PullImageRequest { image: Some(image_spec(&image)), auth, sandbox_config: None };
        let answer = self.call(images.pull_image(request)).await.map_err(|s| {
            ProviderError::new(ProviderErrorKind::ImagePull, format!("pulling image {image:?}: {}", s.message()))
        })?;
        Ok(PreparedImage { image_id: answer.image_ref })
    }

    async fn prepare_pod(&self, pod: &Pod, log_directory: &Path) -> Result<Vec<std::net::IpAddr>, ProviderError> {
        self.learn_runtime_name().await;
        let config = self.sandbox_config(pod, log_directory.display().to_string());
        self.sandbox(pod, &config).await?;
        Ok(self.pod_ips(pod.metadata.uid.as_deref().unwrap_or_default()).await)
    }

    fn mounts_files(&self, _: &Pod) -> bool {
        true
    }

    fn reads_cdi(&self, _: &Pod) -> bool {
        self.inner.reads_cdi.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn update_container_resources(
        &self,
        pod: &Pod,
        id: &ContainerId,
        container: &Container,
    ) -> Result<(), ProviderError> {
        let mut runtime = self.runtime().await?;
        let linux = cri::LinuxContainerResources {
            oom_score_adj: self.inner.oom.adjustment(pod, container),
            ..resources(container)
        };
        let request = cri::UpdateContainerResourcesRequest {
            container_id: id.0.clone(),
            linux: Some(linux),
            annotations: HashMap::new(),
        };
        match self.call(runtime.update_container_resources(request)).await {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Err(ProviderError::new(
                ProviderErrorKind::NotFound,
                format!("UpdateContainerResources: {}", describe(&s)),
            )),
            Err(s) => Err(other("UpdateContainerResources", &s)),
        }
    }

    async fn update_pod_resources(&self, pod: &Pod) -> Result<(), ProviderError> {
        let Some(cgroups) = &self.inner.config.pod_cgroups else { return Ok(()) };
        cgroups
            .ensure_pod(pod)
            .map(|_| ())
            .map_err(|e| ProviderError::new(ProviderErrorKind::Other, format!("cannot update the pod's cgroup: {e}")))
    }

    fn runtime_version(&self) -> String {
        self.inner.runtime_version.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default()
    }

    fn supports_strict_supplemental_groups(&self) -> bool {
        self.inner.strict_supplemental_groups.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn network_readiness(&self, _: &Pod) -> Option<watch::Receiver<Option<String>>> {
        Some(self.inner.network.subscribe())
    }

    async fn start_container(&self, launch: &ContainerLaunch) -> Result<ContainerId, ProviderError> {
        self.learn_runtime_name().await;
        if security::asks_non_root(&launch.pod, &launch.container) {
            let image = launch.container.image.as_deref().unwrap_or_default();
            let user = self.image_user(image).await?;
            security::verify_run_as_non_root(&launch.pod, &launch.container, &user)
                .map_err(|message| ProviderError::new(ProviderErrorKind::Config, message))?;
        }
        // The sandbox's log directory holds `<container>/<restart>.log`.
        let log_directory = launch.log_path.parent().and_then(Path::parent).map(|p| p.display().to_string());
        let config = self.sandbox_config(&launch.pod, log_directory.unwrap_or_default());
        let sandbox_id = self.sandbox(&launch.pod, &config).await?;
        let request = cri::CreateContainerRequest {
            pod_sandbox_id: sandbox_id.clone(),
            config: Some(container_config(launch, &self.inner.oom)),
            sandbox_config: Some(config),
        };
        let mut runtime = self.runtime().await?;
        let created = self.call(runtime.create_container(request)).await.map_err(|s| {
            ProviderError::new(ProviderErrorKind::CannotRun, format!("CreateContainer: {}", describe(&s)))
        })?;
        let id = created.container_id;
        self.call(runtime.start_container(cri::StartContainerRequest { container_id: id.clone() })).await.map_err(
            |s| ProviderError::new(ProviderErrorKind::CannotRun, format!("StartContainer: {}", s.message())),
        )?;
        tracing::info!(container = %launch.container.name, %id, sandbox = %sandbox_id, "container started");
        Ok(ContainerId(id))
    }

    async fn wait_container(&self, id: &ContainerId) -> Result<ContainerExit, ProviderError> {
        struct Waiting<'a>(&'a Inner, &'a str);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.waited.lock().unwrap_or_else(|p| p.into_inner()).remove(self.1);
            }
        }
        self.inner.waited.lock().unwrap_or_else(|p| p.into_inner()).insert(id.0.clone());
        let _waiting = Waiting(&self.inner, &id.0);
        self.ensure_relist();
        let mut relisted = self.inner.relisted.subscribe();
        loop {
            let status = self.status(&id.0).await?;
            if status.state == cri::ContainerState::ContainerExited as i32 {
                let reason = Some(status.reason.clone()).filter(|r| !r.is_empty() && r != "Completed" && r != "Error");
                return Ok(ContainerExit {
                    exit_code: status.exit_code,
                    reason,
                    message: Some(status.message).filter(|m| !m.is_empty()),
                    finished_at: timestamp(status.finished_at),
                });
            }
            // Until a relist no longer shows it running.
            loop {
                if relisted.changed().await.is_err() {
                    return Err(ProviderError::new(ProviderErrorKind::Other, "the provider is gone"));
                }
                if !relisted.borrow_and_update().1.contains(&id.0) {
                    break;
                }
            }
        }
    }

    async fn stop_container(&self, id: &ContainerId, grace: Duration) -> Result<(), ProviderError> {
        let mut runtime = self.runtime().await?;
        let timeout = i64::try_from(grace.as_secs() + u64::from(grace.subsec_nanos() > 0)).unwrap_or(i64::MAX);
        let request = cri::StopContainerRequest { container_id: id.0.clone(), timeout };
        match self.call_within(self.inner.config.call_timeout + grace, runtime.stop_container(request)).await {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(s) => Err(other("StopContainer", &s)),
        }
    }

    async fn exec_sync(
        &self,
        id: &ContainerId,
        command: &[String],
        timeout: Duration,
    ) -> Result<ExecOutput, ProviderError> {
        let mut runtime = self.runtime().await?;
        let seconds = i64::try_from(timeout.as_secs().max(1)).unwrap_or(i64::MAX);
        let request = cri::ExecSyncRequest { container_id: id.0.clone(), cmd: command.to_vec(), timeout: seconds };
        // The runtime ends the command at `timeout`; the call gets a little
        // longer to say so.
        match self.call_within(timeout + self.inner.config.call_timeout, runtime.exec_sync(request)).await {
            Ok(out) => Ok(ExecOutput { exit_code: out.exit_code, stdout: out.stdout, stderr: out.stderr }),
            Err(s) if s.code() == tonic::Code::DeadlineExceeded => Err(ProviderError::new(
                ProviderErrorKind::Timeout,
                format!("command {:?} timed out after {timeout:?}", command.join(" ")),
            )),
            Err(s) if s.code() == tonic::Code::NotFound => {
                Err(ProviderError::new(ProviderErrorKind::NotFound, format!("ExecSync: {}", describe(&s))))
            }
            Err(s) => Err(other("ExecSync", &s)),
        }
    }

    async fn exec(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        let mut runtime = self.runtime().await?;
        let request = cri::ExecRequest {
            container_id: id.0.clone(),
            cmd: request.command.clone(),
            tty: request.tty,
            stdin: request.stdin,
            stdout: request.stdout,
            stderr: request.stderr,
        };
        let answer = self.call(runtime.exec(request)).await.map_err(|s| other("Exec", &s))?;
        Ok(StreamingEndpoint::Url(answer.url))
    }

    async fn container_stats(&self, id: &ContainerId) -> Result<ContainerStats, ProviderError> {
        let mut runtime = self.runtime().await?;
        let request = cri::ContainerStatsRequest { container_id: id.0.clone() };
        let answer = match self.call(runtime.container_stats(request)).await {
            Ok(answer) => answer,
            Err(s) if s.code() == tonic::Code::NotFound => {
                return Err(ProviderError::new(
                    ProviderErrorKind::NotFound,
                    format!("ContainerStats: {}", describe(&s)),
                ));
            }
            Err(s) => return Err(other("ContainerStats", &s)),
        };
        let stats = answer.stats.unwrap_or_default();
        let memory = stats.memory.unwrap_or_default();
        Ok(ContainerStats {
            cpu_usage_core_nanoseconds: stats.cpu.and_then(|c| c.usage_core_nano_seconds).map(|v| v.value),
            memory_working_set_bytes: memory.working_set_bytes.map(|v| v.value),
            memory_usage_bytes: memory.usage_bytes.map(|v| v.value),
            memory_rss_bytes: memory.rss_bytes.map(|v| v.value),
            memory_page_faults: memory.page_faults.map(|v| v.value),
            memory_major_page_faults: memory.major_page_faults.map(|v| v.value),
            fs_used_bytes: stats.writable_layer.and_then(|l| l.used_bytes).map(|v| v.value),
        })
    }

    async fn attach(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        let mut runtime = self.runtime().await?;
        let request = cri::AttachRequest {
            container_id: id.0.clone(),
            stdin: request.stdin,
            tty: request.tty,
            stdout: request.stdout,
            stderr: request.stderr,
        };
        let answer = self.call(runtime.attach(request)).await.map_err(|s| other("Attach", &s))?;
        Ok(StreamingEndpoint::Url(answer.url))
    }

    async fn port_forward(&self, pod_uid: &str, ports: &[u16]) -> Result<StreamingEndpoint, ProviderError> {
        let entry = self.inner.sandboxes.lock().unwrap_or_else(|p| p.into_inner()).get(pod_uid).cloned();
        let sandbox = match entry {
            Some(entry) => entry.lock().await.clone(),
            None => None,
        };
        let Some(sandbox) = sandbox else {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("pod {pod_uid} has no sandbox")));
        };
        let mut runtime = self.runtime().await?;
        let request =
            cri::PortForwardRequest { pod_sandbox_id: sandbox, port: ports.iter().map(|p| i32::from(*p)).collect() };
        let answer = self.call(runtime.port_forward(request)).await.map_err(|s| other("PortForward", &s))?;
        Ok(StreamingEndpoint::Url(answer.url))
    }

    async fn running_containers(&self) -> Result<Vec<RunningContainer>, ProviderError> {
        self.learn_runtime_name().await;
        let mut running = Vec::new();
        for container in self.list_running_cri().await? {
            let Some(uid) = container.labels.get(POD_UID_LABEL).cloned() else { continue };
            let name = container.metadata.as_ref().map(|m| m.name.clone()).unwrap_or_default();
            let restart_count = container
                .annotations
                .get(RESTART_COUNT_ANNOTATION)
                .and_then(|c| c.parse().ok())
                .or(container.metadata.as_ref().map(|m| m.attempt))
                .unwrap_or(0);
            let started_at = match self.status(&container.id).await {
                Ok(status) => timestamp(status.started_at),
                Err(_) => timestamp(container.created_at),
            };
            // Its sandbox is the pod's.
            let entry = {
                let mut sandboxes = self.inner.sandboxes.lock().unwrap_or_else(|p| p.into_inner());
                Arc::clone(sandboxes.entry(uid.clone()).or_default())
            };
            entry.lock().await.get_or_insert_with(|| container.pod_sandbox_id.clone());
            running.push(RunningContainer {
                id: ContainerId(container.id),
                pod_uid: uid,
                container_name: name,
                restart_count,
                started_at,
            });
        }
        self.sweep_pod_cgroups(&running);
        Ok(running)
    }

    /// One `ListContainers` of the running ones.
    async fn started_at(&self, id: &ContainerId) -> Result<Timestamp, ProviderError> {
        let status = self.status(&id.0).await?;
        if status.started_at <= 0 {
            return Err(ProviderError::new(ProviderErrorKind::Other, format!("container {} has not started", id.0)));
        }
        Ok(timestamp(status.started_at))
    }

    async fn list_running(&self) -> Result<Vec<(String, ContainerId)>, ProviderError> {
        Ok(self
            .list_running_cri()
            .await?
            .into_iter()
            .filter_map(|c| Some((c.labels.get(POD_UID_LABEL)?.clone(), ContainerId(c.id))))
            .collect())
    }

    /// The pod's cgroup as a whole (when the node gives pods their own) and
    /// its sandbox's network namespace (`/proc/<pid>/net/dev` of the
    /// sandbox's process; none for a pod in the host's network).
    async fn pod_stats(&self, pod: &Pod) -> Result<kubelet_provider::PodStats, ProviderError> {
        let mut stats = kubelet_provider::PodStats::default();
        if let Some(cgroups) = &self.inner.config.pod_cgroups
            && cgroups.settings().driver == kubelet_support::cgroups::CgroupDriver::Cgroupfs
        {
            let group = cgroups.pod_group(pod);
            let fs = cgroups.fs();
            if let Ok(memory) = fs.memory(&group) {
                stats.memory_usage_bytes = Some(memory.usage);
                stats.memory_working_set_bytes = Some(memory.working_set);
                stats.memory_rss_bytes = Some(memory.rss);
            }
            stats.cpu_usage_core_nanoseconds = fs.cpu_usage_ns(&group).ok();
            stats.cgroup = Some(group);
        }
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        if !host_network && let Some(pid) = self.sandbox_pid(uid).await {
            match std::fs::read_to_string(format!("/proc/{pid}/net/dev")) {
                Ok(table) => stats.network = kubelet_provider::InterfaceStats::parse_net_dev(&table),
                Err(error) => tracing::debug!(pod.uid = %uid, pid, %error, "cannot read the sandbox's network stats"),
            }
        }
        Ok(stats)
    }

    async fn pod_ips(&self, pod_uid: &str) -> Vec<std::net::IpAddr> {
        let entry = self.inner.sandboxes.lock().unwrap_or_else(|p| p.into_inner()).get(pod_uid).cloned();
        let Some(entry) = entry else { return Vec::new() };
        let Some(id) = entry.lock().await.clone() else { return Vec::new() };
        let Ok(mut runtime) = self.runtime().await else { return Vec::new() };
        let request = cri::PodSandboxStatusRequest { pod_sandbox_id: id.clone(), verbose: false };
        let status = match self.call(runtime.pod_sandbox_status(request)).await {
            Ok(answer) => answer.status,
            Err(status) => {
                tracing::warn!(pod.uid = %pod_uid, sandbox = %id, error = %describe(&status), "PodSandboxStatus failed");
                None
            }
        };
        let Some(network) = status.and_then(|s| s.network) else { return Vec::new() };
        std::iter::once(network.ip)
            .chain(network.additional_ips.into_iter().map(|ip| ip.ip))
            .filter_map(|ip| ip.parse().ok())
            .collect()
    }

    async fn remove_pod(&self, pod_uid: &str) -> Result<(), ProviderError> {
        self.inner.sandboxes.lock().unwrap_or_else(|p| p.into_inner()).remove(pod_uid);
        let mut runtime = self.runtime().await?;
        let filter = cri::PodSandboxFilter {
            label_selector: HashMap::from([(POD_UID_LABEL.to_owned(), pod_uid.to_owned())]),
            ..Default::default()
        };
        let listed = self
            .call(runtime.list_pod_sandbox(cri::ListPodSandboxRequest { filter: Some(filter) }))
            .await
            .map_err(|s| other("ListPodSandbox", &s))?;
        for sandbox in listed.items {
            let id = sandbox.id;
            self.call(runtime.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: id.clone() }))
                .await
                .map_err(|s| other("StopPodSandbox", &s))?;
            match self
                .call(runtime.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: id.clone() }))
                .await
            {
                Ok(_) => {}
                // Something of it was already gone (a container removed
                // concurrently): what is asked, no sandbox, holds.
                Err(s) if s.code() == tonic::Code::NotFound => {
                    tracing::debug!(pod.uid = %pod_uid, sandbox = %id, error = %describe(&s), "RemovePodSandbox: already gone");
                }
                Err(s) => return Err(other("RemovePodSandbox", &s)),
            }
            tracing::info!(pod.uid = %pod_uid, sandbox = %id, "pod sandbox removed");
        }
        if let Some(cgroups) = &self.inner.config.pod_cgroups
            && let Err(error) = cgroups.remove_pod(pod_uid)
        {
            // Left for the sweep at the next start.
            tracing::warn!(pod.uid = %pod_uid, %error, "cannot remove the pod's cgroup");
        }
        Ok(())
    }

    async fn collect_containers(&self, keep: usize) -> Result<kubelet_provider::ContainerGcReport, ProviderError> {
        self.remove_exited(keep).await
    }

    async fn collect_images(
        &self,
        policy: &kubelet_provider::ImageGcPolicy,
        all_unused: bool,
    ) -> Result<kubelet_provider::ImageGcReport, ProviderError> {
        self.remove_unused_images(policy, all_unused).await
    }

    async fn reopen_container_log(&self, id: &ContainerId) -> Result<(), ProviderError> {
        let mut runtime = self.runtime().await?;
        let request = cri::ReopenContainerLogRequest { container_id: id.0.clone() };
        self.call(runtime.reopen_container_log(request)).await.map_err(|s| other("ReopenContainerLog", &s))?;
        Ok(())
    }

    async fn runtime_process(&self) -> Option<u32> {
        // The process at the other end of the runtime's socket.
        let path = socket_path_of(&self.inner.config.endpoint);
        let stream =
            tokio::time::timeout(Duration::from_secs(2), tokio::net::UnixStream::connect(path)).await.ok()?.ok()?;
        stream.peer_cred().ok()?.pid().and_then(|pid| u32::try_from(pid).ok()).filter(|pid| *pid > 0)
    }

    async fn image_fs_path(&self) -> Option<std::path::PathBuf> {
        // The runtime's image file system (`ImageFsInfo`), by its mount point.
        let mut images = self.images().await.ok()?;
        let answer = match self.call(images.image_fs_info(cri::ImageFsInfoRequest {})).await {
            Ok(answer) => answer,
            Err(status) => {
                tracing::warn!(error = %describe(&status), "ImageFsInfo failed: imagefs is watched on the root dir");
                return None;
            }
        };
        let mountpoint = answer.image_filesystems.first()?.fs_id.as_ref()?.mountpoint.clone();
        (!mountpoint.is_empty()).then(|| mountpoint.into())
    }

    fn runtime_type(&self, _: &Pod) -> String {
        self.inner.runtime_name.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default()
    }

    fn node_labels(&self) -> BTreeMap<String, String> {
        BTreeMap::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(resources: serde_json::Value) -> Container {
        serde_json::from_value(serde_json::json!({"name": "c", "image": "busybox", "resources": resources}))
            .expect("container")
    }

    #[test]
    fn resources_follow_upstream() {
        let limited = resources(&container(
            serde_json::json!({"requests": {"cpu": "250m"}, "limits": {"cpu": "500m", "memory": "16Mi"}}),
        ));
        assert_eq!((limited.cpu_shares, limited.cpu_period, limited.cpu_quota), (256, 100_000, 50_000));
        assert_eq!(limited.memory_limit_in_bytes, 16 << 20);
        let none = resources(&container(serde_json::json!({})));
        assert_eq!((none.cpu_shares, none.cpu_period, none.cpu_quota, none.memory_limit_in_bytes), (2, 0, 0, 0));
        // A limit alone is the request too.
        let limit_only = resources(&container(serde_json::json!({"limits": {"cpu": "2"}})));
        assert_eq!((limit_only.cpu_shares, limit_only.cpu_quota), (2048, 200_000));
    }
}
