//! The eviction manager: every period it measures the node's signals,
//! sets the pressure conditions, and while a threshold is met (a soft one
//! for its grace period) evicts one pod, ranked as upstream ranks them.
//!
//! - **Signals**: `memory.available` is capacity less the working set
//!   (`/proc/meminfo`: total less free less inactive file pages, as
//!   `/stats/summary` reports the node); `allocatableMemory.available` is
//!   the `kubepods` group's limit less its working set, watched with the
//!   hard `memory.available` threshold when pods have their cgroups;
//!   `nodefs.*` from `statvfs` of the root dir; `imagefs.*` from the
//!   runtime's image file system (CRI `ImageFsInfo`), else the root dir's;
//!   `pid.available` is the node's process IDs less the processes running.
//! - **Conditions**: a condition holds while one of its thresholds is met,
//!   and for `--eviction-pressure-transition-period` after the last time.
//! - **Ranking**: memory: pods using more than they request first, then
//!   lower priority, then more use above the request; disk: the same with
//!   ephemeral storage (logs and emptyDirs on the root dir's file system);
//!   pids: lower priority, then more processes. Pods without figures come
//!   first (as upstream). Critical pods (static, mirror, priority of
//!   2,000,000,000 or more) are never evicted.
//! - **One pod per pass**, and the next pass waits until it has stopped.
//!   A hard threshold stops the pod at once (grace 0); a soft one gives it
//!   its own grace period, at most `--eviction-max-pod-grace-period` when
//!   that is set.
//!
//! - **Disk first from the node**: under disk pressure, exited containers
//!   and every unused image are removed first; a pod is evicted only if
//!   that was not enough.
//!
//! - **Local storage limits** first (`emptyDir.sizeLimit`, the pod's and
//!   each container's `ephemeral-storage` limit; `super::local_storage`):
//!   every pod over one is evicted at once, and that pass evicts nothing
//!   for the thresholds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kubelet_provider::Provider;
use kubelet_support::cgroups::CgroupFs;
use tokio_util::sync::CancellationToken;

use super::{Signal, Threshold, ThresholdValue, Thresholds};
use crate::events::{EventRecorder, EventType};
use crate::pod::{Eviction, Pods};
use crate::pressure::{Pressure, PressureState};

/// How the manager runs.
#[derive(Clone, Debug)]
pub struct EvictionSettings {
    /// The thresholds.
    pub thresholds: Thresholds,
    /// How long a condition holds after its thresholds were last met
    /// (`--eviction-pressure-transition-period`, 5 min).
    pub pressure_transition_period: Duration,
    /// The most grace a pod evicted for a soft threshold gets
    /// (`--eviction-max-pod-grace-period`; zero: its own).
    pub max_pod_grace_period: Duration,
    /// How often the signals are measured (upstream: 10 s).
    pub period: Duration,
    /// How long the pass after an eviction waits for the pod to stop.
    pub cleanup_timeout: Duration,
    /// The node's root dir (`nodefs`, pods' logs and emptyDirs).
    pub root_dir: PathBuf,
    /// The cgroup file system and the `kubepods` group, when pods have
    /// their cgroups (`allocatableMemory.available`).
    pub kubepods: Option<(CgroupFs, String)>,
    /// Under disk pressure, exited containers and unused images go before
    /// any pod: images by this policy's pins and minimum age.
    pub image_gc: kubelet_provider::ImageGcPolicy,
}

impl EvictionSettings {
    /// Upstream's defaults for a node at `root_dir`.
    pub fn new(root_dir: impl Into<PathBuf>) -> EvictionSettings {
        EvictionSettings {
            thresholds: Thresholds::default(),
            pressure_transition_period: Duration::from_secs(300),
            max_pod_grace_period: Duration::ZERO,
            period: Duration::from_secs(10),
            cleanup_timeout: Duration::from_secs(30),
            root_dir: root_dir.into(),
            kubepods: None,
            image_gc: kubelet_provider::ImageGcPolicy::default(),
        }
    }
}

/// One signal's measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observation {
    /// What is left.
    pub available: u128,
    /// The whole.
    pub capacity: u128,
}

/// The signals measured in one pass.
pub(crate) type Observations = BTreeMap<Signal, Observation>;

/// Measures the host's signals.
pub fn observe(settings: &EvictionSettings, image_fs: Option<&Path>) -> Observations {
    let mut observed = Observations::new();
    if let Some((total, working_set)) = meminfo_working_set() {
        let observation = Observation { available: total.saturating_sub(working_set), capacity: total };
        observed.insert(Signal::MemoryAvailable, observation);
    }
    if let Some((fs, kubepods)) = &settings.kubepods
        && let Ok(memory) = fs.memory(kubepods)
    {
        let limit = fs.memory_limit(kubepods).map(u128::from).or_else(|| meminfo_working_set().map(|(t, _)| t));
        if let Some(limit) = limit {
            let working_set = u128::from(memory.working_set);
            let observation = Observation { available: limit.saturating_sub(working_set), capacity: limit };
            observed.insert(Signal::AllocatableMemoryAvailable, observation);
        }
    }
    let nodefs = statvfs(&settings.root_dir);
    let imagefs = image_fs.and_then(statvfs).or(nodefs);
    for (stats, bytes, inodes) in [
        (nodefs, Signal::NodefsAvailable, Signal::NodefsInodesFree),
        (imagefs, Signal::ImagefsAvailable, Signal::ImagefsInodesFree),
    ] {
        if let Some(stats) = stats {
            observed.insert(bytes, Observation { available: stats.available, capacity: stats.capacity });
            if stats.inodes > 0 {
                observed.insert(inodes, Observation { available: stats.inodes_free, capacity: stats.inodes });
            }
        }
    }
    if let Some(max) = pid_capacity() {
        let running = processes();
        observed.insert(Signal::PidAvailable, Observation { available: max.saturating_sub(running), capacity: max });
    }
    observed
}

/// `/proc/meminfo`'s total and working set (total less free less inactive
/// file pages), in bytes.
fn meminfo_working_set() -> Option<(u128, u128)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        meminfo
            .lines()
            .find(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(':')))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<u128>().ok())
            .map(|kib| kib * 1024)
    };
    let total = field("MemTotal")?;
    let used = total.saturating_sub(field("MemFree")?);
    Some((total, used.saturating_sub(field("Inactive(file)").unwrap_or(0))))
}

#[derive(Clone, Copy, Debug)]
struct FsStats {
    available: u128,
    capacity: u128,
    inodes_free: u128,
    inodes: u128,
}

fn statvfs(path: &Path) -> Option<FsStats> {
    let stats = rustix::fs::statvfs(path).ok()?;
    let block = u128::from(stats.f_frsize);
    Some(FsStats {
        available: u128::from(stats.f_bavail) * block,
        capacity: u128::from(stats.f_blocks) * block,
        inodes_free: u128::from(stats.f_favail),
        inodes: u128::from(stats.f_files),
    })
}

/// The node's process IDs: the lower of `pid_max` and `threads-max`.
pub fn pid_capacity() -> Option<u128> {
    let read =
        |file: &str| std::fs::read_to_string(format!("/proc/sys/kernel/{file}")).ok()?.trim().parse::<u128>().ok();
    match (read("pid_max"), read("threads-max")) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The processes running (`/proc`'s numeric entries).
fn processes() -> u128 {
    std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())))
                .count() as u128
        })
        .unwrap_or(0)
}

/// Which thresholds `observed` meets: the amount, plus the minimum reclaim
/// for those met in the last pass (`previously`), above what is available.
pub(crate) fn met(thresholds: &[Threshold], observed: &Observations, previously: &[usize]) -> Vec<usize> {
    thresholds
        .iter()
        .enumerate()
        .filter(|(i, threshold)| {
            let Some(observation) = observed.get(&threshold.signal) else { return false };
            let mut amount = threshold.value.amount(observation.capacity);
            if previously.contains(i)
                && let Some(reclaim) = threshold.min_reclaim
            {
                amount += reclaim.amount(observation.capacity);
            }
            amount > observation.available
        })
        .map(|(i, _)| i)
        .collect()
}

/// A Quantity in upstream's canonical binary form (`64Mi`, `1536`).
pub(crate) fn binary_quantity(value: u128) -> String {
    canonical(value, 1024, &["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"])
}

/// … in its decimal form (`5k`, `12345`).
pub(crate) fn decimal_quantity(value: u128) -> String {
    canonical(value, 1000, &["k", "M", "G", "T", "P", "E"])
}

fn canonical(value: u128, base: u128, suffixes: &[&str]) -> String {
    let mut amount = value;
    let mut suffix = "";
    for next in suffixes {
        if amount == 0 || !amount.is_multiple_of(base) {
            break;
        }
        amount /= base;
        suffix = next;
    }
    format!("{amount}{suffix}")
}

/// One pod's claim to be evicted.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The pod.
    pub pod: Pod,
    /// Its use of the starved resource (`None`: no figures).
    pub usage: Option<u128>,
    /// What it requests of it.
    pub request: u128,
    /// Each container's use, for the message.
    pub containers: Vec<(String, u128)>,
}

fn priority(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

/// Ranks `candidates` for `signal`: the first is evicted first.
pub fn rank(signal: Signal, candidates: &mut [Candidate]) {
    let by_request = !matches!(signal, Signal::PidAvailable);
    candidates.sort_by(|a, b| {
        // No figures first.
        let known = a.usage.is_some().cmp(&b.usage.is_some());
        let over = |c: &Candidate| by_request && c.usage.is_some_and(|u| u > c.request);
        let excess = |c: &Candidate| c.usage.unwrap_or(0).saturating_sub(if by_request { c.request } else { 0 });
        known.then(over(b).cmp(&over(a))).then(priority(&a.pod).cmp(&priority(&b.pod))).then(excess(b).cmp(&excess(a)))
    });
}

/// Upstream's message for evicting `candidate` for `threshold` (observed
/// as `observation`).
pub(crate) fn message(threshold: &Threshold, observation: Option<&Observation>, candidate: &Candidate) -> String {
    let resource = threshold.signal.resource();
    let quantity =
        |v: u128| if resource == "inodes" || resource == "pids" { decimal_quantity(v) } else { binary_quantity(v) };
    let mut message = format!("The node was low on resource: {resource}. ");
    if let Some(observation) = observation {
        let amount = match threshold.value {
            ThresholdValue::Quantity(q) => q,
            ThresholdValue::Percentage(_) => threshold.value.amount(observation.capacity),
        };
        message.push_str(&format!(
            "Threshold quantity: {}, available: {}. ",
            quantity(amount),
            quantity(observation.available)
        ));
    }
    if resource == "memory" || resource == "ephemeral-storage" {
        let spec = candidate.pod.spec.as_ref();
        for (name, used) in &candidate.containers {
            let container = spec.and_then(|s| s.containers.iter().find(|c| &c.name == name));
            let requested = container
                .and_then(|c| c.resources.as_ref())
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get(resource))
                .map(|q| q.0.clone());
            let request_bytes =
                requested.as_deref().and_then(|q| kubelet_provider::quantity::parse_units(q).ok()).unwrap_or(0);
            if *used > request_bytes {
                message.push_str(&format!(
                    "Container {name} was using {}, request is {}, has larger consumption of {resource}. ",
                    quantity(*used),
                    requested.unwrap_or_else(|| "0".into())
                ));
            }
        }
    }
    message
}

/// The eviction manager of one node.
pub struct EvictionManager {
    settings: EvictionSettings,
    pods: Pods,
    provider: Option<Arc<dyn Provider>>,
    pressure: Pressure,
    recorder: EventRecorder,
    node_name: String,
    /// Every threshold watched: hard, soft, and the allocatable copies.
    thresholds: Vec<Threshold>,
    /// When each met threshold was first seen met.
    first_met: BTreeMap<usize, Instant>,
    /// When each condition's thresholds were last met.
    last_met: BTreeMap<&'static str, Instant>,
    /// The thresholds met in the last pass.
    previously: Vec<usize>,
}

impl EvictionManager {
    /// A manager evicting `pods` (their figures from `provider`), telling
    /// `pressure` the conditions and `recorder` what it does.
    pub fn new(
        settings: EvictionSettings,
        pods: Pods,
        provider: Option<Arc<dyn Provider>>,
        pressure: Pressure,
        recorder: EventRecorder,
        node_name: impl Into<String>,
    ) -> EvictionManager {
        let mut thresholds: Vec<Threshold> = settings.thresholds.hard.clone();
        // As upstream with allocatable enforced on pods: the hard memory
        // threshold is watched on the pods' group too.
        if settings.kubepods.is_some() {
            let copies: Vec<Threshold> = thresholds
                .iter()
                .filter(|t| t.signal == Signal::MemoryAvailable)
                .map(|t| Threshold { signal: Signal::AllocatableMemoryAvailable, ..t.clone() })
                .collect();
            thresholds.extend(copies);
        }
        thresholds.extend(settings.thresholds.soft.iter().cloned());
        EvictionManager {
            settings,
            pods,
            provider,
            pressure,
            recorder,
            node_name: node_name.into(),
            thresholds,
            first_met: BTreeMap::new(),
            last_met: BTreeMap::new(),
            previously: Vec::new(),
        }
    }

    /// Runs passes until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        tracing::info!(
            thresholds = %self.thresholds.iter().map(|t| format!("{}<{}", t.signal, t.value)).collect::<Vec<_>>().join(","),
            period = ?self.settings.period,
            "eviction manager started"
        );
        let image_fs = match &self.provider {
            Some(provider) => provider.image_fs_path().await,
            None => None,
        };
        // Containers' writable layers count against their limits only when
        // they are on the root dir's file system.
        let layers_count = image_fs.as_deref().is_none_or(|fs| device_of(fs) == device_of(&self.settings.root_dir));
        loop {
            let evicted = self.pass(image_fs.as_deref(), layers_count).await;
            for uid in evicted {
                self.wait_stopped(&uid, &shutdown).await;
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.settings.period) => {}
            }
        }
    }

    /// One pass: measure, set the conditions, evict the pods over their
    /// local storage limits, or else at most one pod for a threshold (the
    /// UIDs evicted). `layers_count`: containers' writable layers are on
    /// the root dir's file system.
    pub(crate) async fn pass(&mut self, image_fs: Option<&Path>, layers_count: bool) -> Vec<String> {
        let (observed, met_now, now) = self.update_pressure(image_fs);
        let over_limits = self.local_storage_limits(layers_count).await;
        if !over_limits.is_empty() {
            return over_limits;
        }
        self.threshold_pass(image_fs, observed, met_now, now).await.into_iter().collect()
    }

    /// Evicts every pod over a local storage limit (their UIDs).
    async fn local_storage_limits(&mut self, layers_count: bool) -> Vec<String> {
        let pods: Vec<Pod> = self
            .evictable()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(super::local_storage::has_limits)
            .collect();
        if pods.is_empty() {
            return Vec::new();
        }
        let measured =
            super::local_storage::measure(&self.settings.root_dir, &pods, self.provider.as_ref(), layers_count).await;
        let mut evicted = Vec::new();
        for (pod, storage) in pods.iter().zip(measured) {
            let Some(over) = super::local_storage::exceeded(pod, &storage) else { continue };
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            tracing::warn!(pod.uid = %uid, pod = %pod.metadata.name.as_deref().unwrap_or_default(), signal = over.signal, message = %over.message, "evicting a pod over its local storage limit");
            if self.pods.evict(&uid, Eviction { message: over.message, grace: Duration::ZERO, disruption: false }) {
                self.pods.metrics().evicted(over.signal);
                evicted.push(uid);
            }
        }
        evicted
    }

    /// Measures the signals and sets the pressure conditions: what was
    /// observed, the thresholds met, and when.
    fn update_pressure(&mut self, image_fs: Option<&Path>) -> (Observations, Vec<usize>, Instant) {
        let observed = observe(&self.settings, image_fs);
        let now = Instant::now();
        let met_now = met(&self.thresholds, &observed, &self.previously);
        self.first_met.retain(|i, _| met_now.contains(i));
        for i in &met_now {
            self.first_met.entry(*i).or_insert(now);
            self.last_met.insert(self.thresholds[*i].signal.condition(), now);
        }
        self.previously = met_now.clone();
        let mut state = PressureState::default();
        for (condition, at) in &self.last_met {
            state.set(condition, now.duration_since(*at) < self.settings.pressure_transition_period);
        }
        let before = self.pressure.now();
        if before != state {
            tracing::info!(conditions = ?state.conditions(), "node pressure changed");
        }
        self.pressure.set(state);
        (observed, met_now, now)
    }

    /// The thresholds' part of a pass: evicts at most one pod (its UID).
    async fn threshold_pass(
        &mut self,
        image_fs: Option<&Path>,
        observed: Observations,
        met_now: Vec<usize>,
        now: Instant,
    ) -> Option<String> {
        // Those whose grace period has passed; memory first.
        let mut due: Vec<usize> = met_now
            .into_iter()
            .filter(|i| {
                self.first_met.get(i).is_some_and(|at| now.duration_since(*at) >= self.thresholds[*i].grace_period)
            })
            .collect();
        due.sort_by_key(|i| (self.thresholds[*i].signal.resource() != "memory", *i));
        let index = *due.first()?;
        let threshold = self.thresholds[index].clone();
        let resource = threshold.signal.resource();
        self.recorder.node(
            &self.node_name,
            EventType::Warning,
            "EvictionThresholdMet",
            format!("Attempting to reclaim {resource}"),
        );
        if matches!(resource, "ephemeral-storage" | "inodes") && self.reclaim_node_resources(image_fs, index).await {
            return None;
        }
        let mut candidates = self.candidates(threshold.signal).await;
        if candidates.is_empty() {
            tracing::warn!(signal = %threshold.signal, "a threshold is met but no pod can be evicted");
            return None;
        }
        rank(threshold.signal, &mut candidates);
        let chosen = candidates.swap_remove(0);
        let message = message(&threshold, observed.get(&threshold.signal), &chosen);
        let grace = if threshold.grace_period.is_zero() {
            Duration::ZERO
        } else {
            let own = Duration::from_secs(
                chosen.pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds).unwrap_or(30).max(0) as u64,
            );
            let max = self.settings.max_pod_grace_period;
            if max.is_zero() { own } else { own.min(max) }
        };
        let uid = chosen.pod.metadata.uid.clone().unwrap_or_default();
        tracing::warn!(pod.uid = %uid, pod = %chosen.pod.metadata.name.as_deref().unwrap_or_default(), signal = %threshold.signal, %message, "evicting a pod");
        let evicted = self.pods.evict(&uid, Eviction { message, grace, disruption: true });
        if evicted {
            self.pods.metrics().evicted(&threshold.signal.to_string());
        }
        evicted.then_some(uid)
    }

    /// Reclaims disk without evicting: exited containers, then every
    /// unused image. Whether threshold `index` is no longer met.
    async fn reclaim_node_resources(&mut self, image_fs: Option<&Path>, index: usize) -> bool {
        let Some(provider) = self.provider.clone() else { return false };
        let settings = crate::gc::GcSettings { images: self.settings.image_gc.clone(), ..Default::default() };
        crate::gc::collect_containers(&settings, provider.as_ref(), &self.recorder, &self.node_name).await;
        let freed =
            crate::gc::collect_images(&settings.images, true, provider.as_ref(), &self.recorder, &self.node_name).await;
        let observed = observe(&self.settings, image_fs);
        let still = met(&self.thresholds, &observed, &self.previously).contains(&index);
        tracing::info!(freed, reclaimed = !still, signal = %self.thresholds[index].signal, "node-level reclaim before eviction");
        !still
    }

    /// The pods that may be evicted: not finished, not critical.
    fn evictable(&self) -> impl Iterator<Item = Pod> {
        self.pods
            .store()
            .list()
            .into_iter()
            .filter(|p| !matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")))
            .filter(|p| !kubelet_provider::qos::is_critical(p))
    }

    /// The pods that may be evicted, with their figures for `signal`.
    async fn candidates(&self, signal: Signal) -> Vec<Candidate> {
        let pods: Vec<Pod> = self.evictable().collect();
        let resource = signal.resource();
        let mut candidates = Vec::new();
        if resource == "memory" {
            let (usage, _) = crate::pod::usage::pod_usage(pods.clone(), self.provider.as_ref()).await;
            for (pod, usage) in pods.into_iter().zip(usage) {
                let containers: Vec<(String, u128)> = usage
                    .containers
                    .iter()
                    .filter_map(|c| c.stats.memory_working_set_bytes.map(|b| (c.name.clone(), u128::from(b))))
                    .collect();
                let total = (!containers.is_empty()).then(|| containers.iter().map(|(_, b)| b).sum());
                let request = kubelet_support::cgroups::pod_totals(&pod).memory_request;
                candidates.push(Candidate { pod, usage: total, request, containers });
            }
        } else if resource == "pids" {
            for pod in pods {
                let usage = self.pod_processes(&pod);
                candidates.push(Candidate { pod, usage, request: 0, containers: Vec::new() });
            }
        } else {
            for pod in pods {
                let usage = pod_storage(&self.settings.root_dir, &pod);
                let request = storage_request(&pod);
                candidates.push(Candidate { pod, usage: Some(usage), request, containers: Vec::new() });
            }
        }
        candidates
    }

    /// The processes of `pod` (its cgroup's `pids.current`), if known.
    fn pod_processes(&self, pod: &Pod) -> Option<u128> {
        let (fs, kubepods) = self.settings.kubepods.as_ref()?;
        let dir = fs.dir("pids", &kubelet_support::cgroups::pod_group(kubepods, pod));
        std::fs::read_to_string(dir.join("pids.current")).ok()?.trim().parse().ok()
    }

    /// Waits until the evicted pod has stopped (or the cleanup timeout).
    async fn wait_stopped(&self, uid: &str, shutdown: &CancellationToken) {
        let store = self.pods.store();
        let stopped = |pods: &BTreeMap<String, Pod>| {
            pods.get(uid).is_none_or(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed"))
        };
        tokio::select! {
            () = shutdown.cancelled() => {}
            found = store.wait_for(self.settings.cleanup_timeout, stopped) => {
                if found.is_none() {
                    tracing::warn!(pod.uid = %uid, "the evicted pod has not stopped within the cleanup timeout");
                }
            }
        }
    }
}

/// Bytes `pod` keeps on the root dir's file system: its logs and its
/// emptyDirs (not those of medium Memory).
fn pod_storage(root_dir: &Path, pod: &Pod) -> u128 {
    let (logs, empty_dirs) = storage_dirs(root_dir, pod);
    let device = device_of(root_dir);
    disk_usage(&logs, device) + disk_usage(&empty_dirs, device)
}

/// The pod's log dir and the dir of its emptyDirs.
pub(super) fn storage_dirs(root_dir: &Path, pod: &Pod) -> (PathBuf, PathBuf) {
    let meta = &pod.metadata;
    let uid = meta.uid.as_deref().unwrap_or_default();
    let logs = crate::pod::pod_log_dir(
        root_dir,
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default(),
        uid,
    );
    (logs, root_dir.join("pods").join(uid).join("volumes/kubernetes.io~empty-dir"))
}

/// The device `path` is on.
pub(super) fn device_of(path: &Path) -> Option<u64> {
    std::fs::metadata(path).map(|m| std::os::unix::fs::MetadataExt::dev(&m)).ok()
}

/// Bytes of the files under `path` on `device`.
pub(super) fn disk_usage(path: &Path, device: Option<u64>) -> u128 {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(meta) = std::fs::symlink_metadata(path) else { return 0 };
    if device.is_some_and(|d| d != meta.dev()) {
        return 0;
    }
    let own = u128::from(meta.blocks()) * 512;
    if !meta.is_dir() {
        return own;
    }
    let children: u128 = std::fs::read_dir(path)
        .map(|entries| entries.flatten().map(|e| disk_usage(&e.path(), device)).sum())
        .unwrap_or(0);
    own + children
}

/// The pod's ephemeral-storage requests, summed.
fn storage_request(pod: &Pod) -> u128 {
    let spec = pod.spec.as_ref();
    spec.into_iter()
        .flat_map(|s| s.containers.iter())
        .filter_map(|c| c.resources.as_ref()?.requests.as_ref()?.get("ephemeral-storage").cloned())
        .filter_map(|q| kubelet_provider::quantity::parse_units(&q.0).ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, priority: i32, memory_request: Option<&str>) -> Pod {
        let resources =
            memory_request.map_or(serde_json::json!({}), |r| serde_json::json!({"requests": {"memory": r}}));
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "uid": name},
            "spec": {"priority": priority, "containers": [{"name": "main", "resources": resources}]},
        }))
        .expect("pod")
    }

    fn candidate(name: &str, priority: i32, request: u128, usage: Option<u128>) -> Candidate {
        let pod = pod(name, priority, Some(&request.to_string()));
        Candidate { pod, usage, request, containers: usage.map(|u| vec![("main".into(), u)]).unwrap_or_default() }
    }

    #[test]
    fn memory_ranking_puts_usage_above_requests_first_then_priority_then_excess() {
        let mut candidates = vec![
            candidate("within", 0, 100, Some(50)),
            candidate("over-small", 0, 100, Some(110)),
            candidate("over-big", 0, 100, Some(500)),
            candidate("over-important", 10, 0, Some(900)),
            candidate("unknown", 100, 0, None),
        ];
        rank(Signal::MemoryAvailable, &mut candidates);
        let order: Vec<&str> = candidates.iter().map(|c| c.pod.metadata.name.as_deref().unwrap_or_default()).collect();
        assert_eq!(order, ["unknown", "over-big", "over-small", "over-important", "within"]);
    }

    #[test]
    fn thresholds_are_met_below_their_amount_plus_reclaim_once_met() {
        let thresholds = vec![Threshold {
            signal: Signal::MemoryAvailable,
            value: ThresholdValue::Quantity(100),
            grace_period: Duration::ZERO,
            min_reclaim: Some(ThresholdValue::Quantity(50)),
        }];
        let at = |available| Observations::from([(Signal::MemoryAvailable, Observation { available, capacity: 1000 })]);
        assert_eq!(met(&thresholds, &at(99), &[]), [0]);
        assert!(met(&thresholds, &at(120), &[]).is_empty());
        assert_eq!(met(&thresholds, &at(120), &[0]), [0], "met last time: until 150 is available");
        assert!(met(&thresholds, &at(200), &[0]).is_empty());
        assert!(met(&thresholds, &Observations::new(), &[]).is_empty(), "an unmeasured signal meets nothing");
    }

    #[test]
    fn quantities_and_messages_read_as_upstreams() {
        assert_eq!(binary_quantity(100 << 20), "100Mi");
        assert_eq!(binary_quantity(222_298_112), "212Mi");
        assert_eq!(binary_quantity(1536), "1536");
        assert_eq!(binary_quantity(0), "0");
        assert_eq!(decimal_quantity(5000), "5k");
        let threshold = Threshold {
            signal: Signal::MemoryAvailable,
            value: ThresholdValue::Quantity(100 << 20),
            grace_period: Duration::ZERO,
            min_reclaim: None,
        };
        let hog = candidate("hog", 0, 0, Some(300 << 20));
        let observation = Observation { available: 96 << 10, capacity: 1 << 30 };
        assert_eq!(
            message(&threshold, Some(&observation), &hog),
            "The node was low on resource: memory. Threshold quantity: 100Mi, available: 96Ki. \
             Container main was using 300Mi, request is 0, has larger consumption of memory. "
        );
    }
}
