//! Control groups as the kubelet lays them out with its `cgroupfs` driver,
//! on cgroup v1 (a hierarchy per controller under `/sys/fs/cgroup/<name>`)
//! and v2 (one unified hierarchy).
//!
//! **The hierarchy.** Under a root (`--cgroup-root`, `/` by default) the
//! node makes `kubepods`, limited to what pods may use (node allocatable);
//! below it `burstable` and `besteffort`. Each pod gets `pod<uid>` under
//! its class's group (Guaranteed pods sit directly under `kubepods`), with
//! the pod's limits ([`pod_resources`]); the runtime puts the pod's sandbox
//! and containers under it (the sandbox's `cgroup_parent`).
//!
//! **The numbers** are upstream's: cpu shares are 1024 per cpu requested
//! (2 at least, 262,144 at most), the CFS quota is the cpu limit over a
//! 100 ms period (1 ms at least), the memory limit is the sum of the
//! containers' limits, set only when every container has one; on v2
//! shares become `cpu.weight` (`1 + (shares − 2) × 9999 / 262142`).
//!
//! What is written, per version: v1 `cpu.shares`, `cpu.cfs_period_us`,
//! `cpu.cfs_quota_us`, `memory.limit_in_bytes`, `pids.max`; v2
//! `cpu.weight`, `cpu.max`, `memory.max`, `pids.max` (with the controllers
//! enabled in each parent's `cgroup.subtree_control`).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::{Container, Pod};

use kubelet_provider::qos::{QosClass, qos_class};
use kubelet_provider::quantity::{parse_milli, parse_units};

/// The least cpu shares a group gets.
pub(crate) const MIN_SHARES: u64 = 2;
/// The most cpu shares a group gets.
pub(crate) const MAX_SHARES: u64 = 262_144;
/// The CFS period, in microseconds.
pub(crate) const QUOTA_PERIOD: u64 = 100_000;
/// The least CFS quota, in microseconds.
pub(crate) const MIN_QUOTA: i64 = 1000;

/// Cpu shares for `milli` millicores.
pub fn shares(milli: u128) -> u64 {
    if milli == 0 {
        return MIN_SHARES;
    }
    u64::try_from(milli * 1024 / 1000).unwrap_or(MAX_SHARES).clamp(MIN_SHARES, MAX_SHARES)
}

/// The CFS quota (µs per [`QUOTA_PERIOD`]) for a limit of `milli`
/// millicores; `None` for no limit.
pub(crate) fn quota(milli: u128) -> Option<i64> {
    if milli == 0 {
        return None;
    }
    Some(i64::try_from(milli * u128::from(QUOTA_PERIOD) / 1000).unwrap_or(i64::MAX).max(MIN_QUOTA))
}

/// cgroup v2's `cpu.weight` for `shares`.
pub(crate) fn cpu_weight(shares: u64) -> u64 {
    if shares >= MAX_SHARES {
        return 10_000;
    }
    1 + (shares.max(MIN_SHARES) - MIN_SHARES) * 9999 / (MAX_SHARES - MIN_SHARES)
}

/// Limits of one group; `None` leaves a file as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CgroupResources {
    /// Cpu shares (v1) or their weight (v2).
    pub cpu_shares: Option<u64>,
    /// The CFS quota in µs per [`QUOTA_PERIOD`]; `Some(-1)`: unlimited.
    pub cpu_quota: Option<i64>,
    /// Bytes of memory at most.
    pub memory_limit: Option<u64>,
    /// Processes at most.
    pub pids_limit: Option<u64>,
}

/// The pod's requests and limits as the kubelet sums them: the app
/// containers, each restartable (sidecar) init container added to them,
/// and the largest init container if it needs more; plus `spec.overhead`
/// (on limits only where a limit is set). Cpu in millicores, memory in
/// bytes; whether every container has a cpu and a memory limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodTotals {
    /// Millicores requested.
    pub cpu_request: u128,
    /// Bytes requested.
    pub memory_request: u128,
    /// Millicores at most (0: none).
    pub cpu_limit: u128,
    /// Bytes at most (0: none).
    pub memory_limit: u128,
    /// Every container has a cpu limit.
    pub cpu_limited: bool,
    /// Every container has a memory limit.
    pub memory_limited: bool,
}

fn amount(container: &Container, limits: bool, resource: &str) -> u128 {
    let resources = container.resources.as_ref();
    let of = |limits: bool| {
        let map = resources.and_then(|r| if limits { r.limits.as_ref() } else { r.requests.as_ref() });
        map.and_then(|m| m.get(resource)).map(|q| {
            let parsed = if resource == "cpu" { parse_milli(&q.0) } else { parse_units(&q.0) };
            parsed.unwrap_or(0)
        })
    };
    // A missing request is the limit, as the API server defaults it.
    if limits { of(true).unwrap_or(0) } else { of(false).or_else(|| of(true)).unwrap_or(0) }
}

/// The totals of `pod`.
pub fn pod_totals(pod: &Pod) -> PodTotals {
    let Some(spec) = pod.spec.as_ref() else { return PodTotals::default() };
    let overhead = |resource: &str| {
        let quantity = spec.overhead.as_ref().and_then(|o| o.get(resource));
        quantity
            .map(|q| if resource == "cpu" { parse_milli(&q.0) } else { parse_units(&q.0) }.unwrap_or(0))
            .unwrap_or(0)
    };
    let mut totals = PodTotals { cpu_limited: true, memory_limited: true, ..PodTotals::default() };
    // The total and whether every container is limited, per resource.
    let sum = |limits: bool, resource: &str| {
        let mut total: u128 = spec.containers.iter().map(|c| amount(c, limits, resource)).sum();
        let mut limited = !limits || spec.containers.iter().all(|c| amount(c, true, resource) > 0);
        let mut sidecars: u128 = 0;
        let mut largest_init: u128 = 0;
        for init in spec.init_containers.iter().flatten() {
            let value = amount(init, limits, resource);
            // What the node holds while this init container runs: the
            // sidecars started so far, and this one.
            let in_use = if init.restart_policy.as_deref() == Some("Always") {
                sidecars += value;
                total += value;
                sidecars
            } else {
                sidecars + value
            };
            largest_init = largest_init.max(in_use);
            if limits && in_use == 0 {
                limited = false;
            }
        }
        let mut value = total.max(largest_init);
        let extra = overhead(resource);
        if !limits || value > 0 {
            value += extra;
        }
        (value, limited)
    };
    (totals.cpu_request, _) = sum(false, "cpu");
    (totals.memory_request, _) = sum(false, "memory");
    (totals.cpu_limit, totals.cpu_limited) = sum(true, "cpu");
    (totals.memory_limit, totals.memory_limited) = sum(true, "memory");
    totals
}

/// The pod cgroup's limits (upstream's `ResourceConfigForPod`): shares from
/// the requests (2 for BestEffort); a quota when every container has a cpu
/// limit (and `cfs_quota` enforces limits); a memory limit when every one
/// has a memory limit; `pids_limit` (`--pod-max-pids`) if given.
pub(crate) fn pod_resources(pod: &Pod, cfs_quota: bool, pids_limit: Option<u64>) -> CgroupResources {
    let totals = pod_totals(pod);
    let mut resources = CgroupResources { pids_limit, ..CgroupResources::default() };
    match qos_class(pod) {
        QosClass::BestEffort => resources.cpu_shares = Some(MIN_SHARES),
        class => {
            resources.cpu_shares = Some(shares(totals.cpu_request));
            let guaranteed = class == QosClass::Guaranteed;
            if guaranteed || totals.cpu_limited {
                resources.cpu_quota = if cfs_quota { quota(totals.cpu_limit) } else { Some(-1) };
            }
            if guaranteed || totals.memory_limited {
                resources.memory_limit = u64::try_from(totals.memory_limit).ok().filter(|m| *m > 0);
            }
        }
    }
    resources
}

/// Which cgroup version the host runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// A hierarchy per controller.
    V1,
    /// One unified hierarchy.
    V2,
}

/// The controllers the node uses, as v1 names its hierarchies.
const V1_CONTROLLERS: [&str; 5] = ["cpu", "cpuacct", "cpuset", "memory", "pids"];
/// … as v2 enables them in `cgroup.subtree_control`.
const V2_CONTROLLERS: [&str; 4] = ["cpu", "cpuset", "memory", "pids"];

/// The host's cgroup file system.
#[derive(Clone, Debug)]
pub struct CgroupFs {
    mount: PathBuf,
    version: CgroupVersion,
}

/// A cgroup operation that failed, with the file it was at.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct CgroupError {
    /// The file or directory.
    pub path: String,
    /// What the kernel said.
    #[source]
    pub source: io::Error,
}

fn at(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError { path: path.display().to_string(), source }
}

impl CgroupFs {
    /// The host's, at `/sys/fs/cgroup`: v2 when it holds
    /// `cgroup.controllers`, v1 when it holds a `memory` hierarchy.
    pub fn detect() -> Option<CgroupFs> {
        CgroupFs::detect_at("/sys/fs/cgroup")
    }

    /// The cgroup file system mounted at `mount`.
    pub(crate) fn detect_at(mount: impl Into<PathBuf>) -> Option<CgroupFs> {
        let mount = mount.into();
        if mount.join("cgroup.controllers").is_file() {
            Some(CgroupFs { mount, version: CgroupVersion::V2 })
        } else if mount.join("memory").is_dir() {
            Some(CgroupFs { mount, version: CgroupVersion::V1 })
        } else {
            None
        }
    }

    /// The version.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The directories of group `name` (`/kubepods/burstable`): one per
    /// controller on v1 (those the host has), one on v2.
    pub(crate) fn dirs(&self, name: &str) -> Vec<PathBuf> {
        let relative = name.trim_start_matches('/');
        match self.version {
            CgroupVersion::V2 => vec![self.mount.join(relative)],
            CgroupVersion::V1 => V1_CONTROLLERS
                .iter()
                .map(|c| self.mount.join(c))
                .filter(|d| d.is_dir())
                .map(|d| d.join(relative))
                .collect(),
        }
    }

    /// Every directory of group `name`: on v1 in every hierarchy mounted
    /// (the runtime makes a container's parents in all of them, blkio and
    /// devices included), on v2 the one.
    pub fn all_dirs(&self, name: &str) -> Vec<PathBuf> {
        let relative = name.trim_start_matches('/');
        match self.version {
            CgroupVersion::V2 => vec![self.mount.join(relative)],
            CgroupVersion::V1 => {
                let Ok(entries) = std::fs::read_dir(&self.mount) else { return Vec::new() };
                let mut seen = std::collections::BTreeSet::new();
                let mut dirs: Vec<PathBuf> = entries
                    .flatten()
                    .map(|e| e.path())
                    // `unified` too: a hybrid host's v2 tree, where runc also makes groups.
                    .filter(|p| p.is_dir())
                    // `cpu` and `cpuacct` may be links to one hierarchy.
                    .filter(|p| seen.insert(std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())))
                    .map(|p| p.join(relative))
                    .collect();
                dirs.sort();
                dirs
            }
        }
    }

    /// The directory of `name` in `controller`'s hierarchy (v1), or in the
    /// unified one (v2).
    pub fn dir(&self, controller: &str, name: &str) -> PathBuf {
        let relative = name.trim_start_matches('/');
        match self.version {
            CgroupVersion::V2 => self.mount.join(relative),
            CgroupVersion::V1 => self.mount.join(controller).join(relative),
        }
    }

    /// Whether group `name` exists.
    pub fn exists(&self, name: &str) -> bool {
        self.dir("memory", name).is_dir()
    }

    /// Makes group `name` (and its parents) and sets `resources` on it.
    pub fn ensure(&self, name: &str, resources: &CgroupResources) -> Result<(), CgroupError> {
        match self.version {
            CgroupVersion::V1 => {
                for dir in self.dirs(name) {
                    make_v1(&dir)?;
                }
            }
            CgroupVersion::V2 => self.make_v2(name)?,
        }
        self.set(name, resources)
    }

    /// Sets `resources` on existing group `name`.
    pub(crate) fn set(&self, name: &str, resources: &CgroupResources) -> Result<(), CgroupError> {
        let write = |controller: &str, file: &str, value: String| {
            let path = self.dir(controller, name).join(file);
            std::fs::write(&path, value).map_err(at(&path))
        };
        match self.version {
            CgroupVersion::V1 => {
                if let Some(shares) = resources.cpu_shares {
                    write("cpu", "cpu.shares", shares.to_string())?;
                }
                if let Some(quota) = resources.cpu_quota {
                    write("cpu", "cpu.cfs_period_us", QUOTA_PERIOD.to_string())?;
                    write("cpu", "cpu.cfs_quota_us", quota.to_string())?;
                }
                if let Some(memory) = resources.memory_limit {
                    write("memory", "memory.limit_in_bytes", memory.to_string())?;
                }
                if let Some(pids) = resources.pids_limit
                    && self.dir("pids", name).is_dir()
                {
                    write("pids", "pids.max", pids.to_string())?;
                }
            }
            CgroupVersion::V2 => {
                if let Some(shares) = resources.cpu_shares {
                    write("cpu", "cpu.weight", cpu_weight(shares).to_string())?;
                }
                if let Some(quota) = resources.cpu_quota {
                    let quota = if quota < 0 { "max".to_owned() } else { quota.to_string() };
                    write("cpu", "cpu.max", format!("{quota} {QUOTA_PERIOD}"))?;
                }
                if let Some(memory) = resources.memory_limit {
                    write("memory", "memory.max", memory.to_string())?;
                }
                if let Some(pids) = resources.pids_limit {
                    write("pids", "pids.max", pids.to_string())?;
                }
            }
        }
        Ok(())
    }

    /// v2: the directories down to `name`, each parent delegating the
    /// controllers it has to its children.
    fn make_v2(&self, name: &str) -> Result<(), CgroupError> {
        let mut dir = self.mount.clone();
        for part in name.split('/').filter(|p| !p.is_empty()) {
            let available = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
            let wanted: Vec<String> = V2_CONTROLLERS
                .iter()
                .filter(|c| available.split_whitespace().any(|a| a == **c))
                .map(|c| format!("+{c}"))
                .collect();
            if !wanted.is_empty() {
                let control = dir.join("cgroup.subtree_control");
                std::fs::write(&control, wanted.join(" ")).map_err(at(&control))?;
            }
            dir.push(part);
            match std::fs::create_dir(&dir) {
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(at(&dir)(e)),
                _ => {}
            }
        }
        Ok(())
    }

    /// Removes group `name` from every hierarchy (it must hold no process
    /// and no group). Gone already is success.
    pub fn remove(&self, name: &str) -> Result<(), CgroupError> {
        for dir in self.all_dirs(name) {
            match std::fs::remove_dir(&dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(at(&dir)(e)),
                _ => {}
            }
        }
        Ok(())
    }

    /// Removes group `name` and the groups under it (left empty by the
    /// runtime), deepest first, from every hierarchy. A group that still
    /// holds a process stays, and says so.
    pub(crate) fn remove_tree(&self, name: &str) -> Result<(), CgroupError> {
        fn remove(dir: &Path) -> Result<(), CgroupError> {
            if let Ok(entries) = std::fs::read_dir(dir) {
                for entry in entries.flatten() {
                    if entry.file_type().is_ok_and(|t| t.is_dir()) {
                        remove(&entry.path())?;
                    }
                }
            }
            match std::fs::remove_dir(dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(at(dir)(e)),
                _ => Ok(()),
            }
        }
        for dir in self.all_dirs(name) {
            remove(&dir)?;
        }
        Ok(())
    }

    /// The names of the groups directly under `name`.
    pub(crate) fn children(&self, name: &str) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.dir("memory", name)) else { return Vec::new() };
        let mut children: Vec<String> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .collect();
        children.sort();
        children
    }

    /// Group `name`'s memory: its usage and its working set (usage less
    /// inactive file pages, as cAdvisor counts it), in bytes.
    pub fn memory(&self, name: &str) -> Result<MemoryUsage, CgroupError> {
        let dir = self.dir("memory", name);
        let (usage_file, inactive_key) = match self.version {
            CgroupVersion::V1 => ("memory.usage_in_bytes", "total_inactive_file"),
            CgroupVersion::V2 => ("memory.current", "inactive_file"),
        };
        let read = |file: &str| {
            let path = dir.join(file);
            std::fs::read_to_string(&path).map_err(at(&path))
        };
        let usage: u64 = read(usage_file)?.trim().parse().unwrap_or(0);
        let stat = read("memory.stat")?;
        let inactive = stat_value(&stat, inactive_key).unwrap_or(0);
        let rss_key = match self.version {
            CgroupVersion::V1 => "total_rss",
            CgroupVersion::V2 => "anon",
        };
        let rss = stat_value(&stat, rss_key).unwrap_or(0);
        Ok(MemoryUsage { usage, working_set: usage.saturating_sub(inactive), rss })
    }

    /// The CPU time group `name` used, in nanoseconds (v1 `cpuacct.usage`,
    /// v2 `cpu.stat`'s `usage_usec`).
    pub fn cpu_usage_ns(&self, name: &str) -> Result<u64, CgroupError> {
        let (dir, file) = match self.version {
            CgroupVersion::V1 => (self.dir("cpuacct", name), "cpuacct.usage"),
            CgroupVersion::V2 => (self.dir("cpu", name), "cpu.stat"),
        };
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path).map_err(at(&path))?;
        Ok(match self.version {
            CgroupVersion::V1 => text.trim().parse().unwrap_or(0),
            CgroupVersion::V2 => stat_value(&text, "usage_usec").unwrap_or(0).saturating_mul(1000),
        })
    }

    /// The memory limit of group `name` in bytes, `None` for none.
    pub fn memory_limit(&self, name: &str) -> Option<u64> {
        let file = match self.version {
            CgroupVersion::V1 => "memory.limit_in_bytes",
            CgroupVersion::V2 => "memory.max",
        };
        let text = std::fs::read_to_string(self.dir("memory", name).join(file)).ok()?;
        // v1 writes "no limit" as a huge page-aligned number.
        text.trim().parse::<u64>().ok().filter(|v| *v < 1 << 62)
    }
}

/// A `key value` line's value in a `*.stat` file.
pub(crate) fn stat_value(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        if k == key { v.trim().parse().ok() } else { None }
    })
}

/// A group's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Bytes charged.
    pub usage: u64,
    /// Bytes charged less inactive file pages.
    pub working_set: u64,
    /// Anonymous memory (v1 `total_rss`, v2 `anon`).
    pub rss: u64,
}

/// v1: makes `dir` and its missing parents; a new `cpuset` group gets its
/// parent's cpus and memory nodes (it starts with none, and a group
/// without them cannot hold a process).
fn make_v1(dir: &Path) -> Result<(), CgroupError> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        make_v1(parent)?;
    }
    match std::fs::create_dir(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(at(dir)(e)),
        _ => {}
    }
    for file in ["cpuset.cpus", "cpuset.mems"] {
        let own = dir.join(file);
        if !own.is_file() {
            continue;
        }
        let empty = std::fs::read_to_string(&own).map(|s| s.trim().is_empty()).unwrap_or(false);
        if empty && let Some(parent) = dir.parent() {
            let inherited = std::fs::read_to_string(parent.join(file)).map_err(at(&parent.join(file)))?;
            std::fs::write(&own, inherited.trim()).map_err(at(&own))?;
        }
    }
    Ok(())
}

/// How the runtime is told where a pod's cgroup is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CgroupDriver {
    /// Paths (`/kubepods/burstable/pod<uid>`); the node makes the groups.
    #[default]
    Cgroupfs,
    /// systemd slices (`kubepods-burstable-pod<uid>.slice`), made by
    /// systemd when the runtime places a container in one. Rustlet does
    /// not talk to systemd: the pod slices carry no pod-level limits.
    Systemd,
}

/// The group of QoS class `class` under `kubepods` (Guaranteed pods sit
/// in `kubepods` itself).
fn class_group(kubepods: &str, class: QosClass) -> String {
    match class {
        QosClass::Guaranteed => kubepods.to_owned(),
        QosClass::Burstable => format!("{kubepods}/burstable"),
        QosClass::BestEffort => format!("{kubepods}/besteffort"),
    }
}

/// The group of `pod` under `kubepods` (`/kubepods/burstable/pod<uid>`).
pub fn pod_group(kubepods: &str, pod: &Pod) -> String {
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    format!("{}/{POD_CGROUP_PREFIX}{uid}", class_group(kubepods, qos_class(pod)))
}

/// The settings of the node's pod hierarchy.
#[derive(Clone, Debug)]
pub struct QosCgroupSettings {
    /// Where `kubepods` goes (`--cgroup-root`; `/`).
    pub root: String,
    /// The driver the runtime uses.
    pub driver: CgroupDriver,
    /// What `kubepods` is limited to (node allocatable, when enforced).
    pub kubepods: CgroupResources,
    /// Processes a pod may hold at most (`--pod-max-pids`).
    pub pod_pids_limit: Option<u64>,
    /// Whether cpu limits become CFS quotas (`--cpu-cfs-quota`).
    pub cfs_quota: bool,
}

impl QosCgroupSettings {
    /// The kubelet's defaults: `/kubepods`, cgroupfs, no limits, quotas on.
    pub fn new() -> QosCgroupSettings {
        QosCgroupSettings {
            root: "/".into(),
            driver: CgroupDriver::Cgroupfs,
            kubepods: CgroupResources::default(),
            pod_pids_limit: None,
            cfs_quota: true,
        }
    }
}

impl Default for QosCgroupSettings {
    fn default() -> Self {
        QosCgroupSettings::new()
    }
}

/// The node's `kubepods` hierarchy and its pods' groups.
#[derive(Debug)]
pub struct PodCgroups {
    fs: CgroupFs,
    settings: QosCgroupSettings,
    /// Burstable pods' cpu requests (millicores) by UID: the `burstable`
    /// group's shares are their sum.
    burstable: Mutex<BTreeMap<String, u128>>,
}

/// The prefix of a pod's group name.
pub(crate) const POD_CGROUP_PREFIX: &str = "pod";

impl PodCgroups {
    /// Makes (or updates) `kubepods`, `kubepods/burstable` and
    /// `kubepods/besteffort` under `settings.root` on `fs`.
    pub fn start(fs: CgroupFs, settings: QosCgroupSettings) -> Result<PodCgroups, CgroupError> {
        let cgroups = PodCgroups { fs, settings, burstable: Mutex::default() };
        if cgroups.settings.driver == CgroupDriver::Cgroupfs {
            let kubepods = cgroups.kubepods();
            cgroups.fs.ensure(&kubepods, &cgroups.settings.kubepods)?;
            let burstable = CgroupResources { cpu_shares: Some(MIN_SHARES), ..CgroupResources::default() };
            cgroups.fs.ensure(&format!("{kubepods}/burstable"), &burstable)?;
            cgroups.fs.ensure(&format!("{kubepods}/besteffort"), &burstable)?;
            tracing::info!(
                root = %kubepods,
                version = ?cgroups.fs.version(),
                limits = ?cgroups.settings.kubepods,
                "pod cgroups under the node's kubepods group"
            );
        } else {
            tracing::warn!(
                "cgroup driver systemd: pods go in kubepods-*.slice groups that systemd makes; Rustlet sets no \
                 pod-level or node-allocatable limits on them (containers keep their own limits)"
            );
        }
        Ok(cgroups)
    }

    /// The cgroup file system.
    pub fn fs(&self) -> &CgroupFs {
        &self.fs
    }

    /// The settings.
    pub fn settings(&self) -> &QosCgroupSettings {
        &self.settings
    }

    /// The `kubepods` group's name (`/kubepods`, or under the root).
    pub fn kubepods(&self) -> String {
        format!("{}/kubepods", self.settings.root.trim_end_matches('/'))
    }

    /// The group of class `class`.
    fn class_group(&self, class: QosClass) -> String {
        class_group(&self.kubepods(), class)
    }

    /// The group of `pod` as a path (`/kubepods/burstable/pod<uid>`).
    pub fn pod_group(&self, pod: &Pod) -> String {
        pod_group(&self.kubepods(), pod)
    }

    /// What the runtime is given as the pod sandbox's `cgroup_parent`.
    pub fn cgroup_parent(&self, pod: &Pod) -> String {
        match self.settings.driver {
            CgroupDriver::Cgroupfs => self.pod_group(pod),
            CgroupDriver::Systemd => {
                // Each part joined by `-`, a part's own `-` as `_`.
                let group = self.pod_group(pod);
                let parts: Vec<String> =
                    group.split('/').filter(|p| !p.is_empty()).map(|p| p.replace('-', "_")).collect();
                format!("{}.slice", parts.join("-"))
            }
        }
    }

    /// Makes `pod`'s group with its limits (again after a restart: the
    /// limits are rewritten) and returns its `cgroup_parent`.
    pub fn ensure_pod(&self, pod: &Pod) -> Result<String, CgroupError> {
        if self.settings.driver == CgroupDriver::Cgroupfs {
            let resources = pod_resources(pod, self.settings.cfs_quota, self.settings.pod_pids_limit);
            self.fs.ensure(&self.pod_group(pod), &resources)?;
            if qos_class(pod) == QosClass::Burstable {
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                self.burstable.lock().unwrap_or_else(|p| p.into_inner()).insert(uid, pod_totals(pod).cpu_request);
                self.update_burstable();
            }
        }
        Ok(self.cgroup_parent(pod))
    }

    /// The `burstable` group's shares: its pods' cpu requests together.
    fn update_burstable(&self) {
        let total: u128 = self.burstable.lock().unwrap_or_else(|p| p.into_inner()).values().sum();
        let resources = CgroupResources { cpu_shares: Some(shares(total)), ..CgroupResources::default() };
        let group = self.class_group(QosClass::Burstable);
        if let Err(error) = self.fs.set(&group, &resources) {
            tracing::warn!(%error, "cannot update the burstable group's cpu shares");
        }
    }

    /// The UIDs of the pods that have a group, and the groups' names.
    pub fn pod_groups(&self) -> Vec<(String, String)> {
        [QosClass::Guaranteed, QosClass::Burstable, QosClass::BestEffort]
            .into_iter()
            .flat_map(|class| {
                let parent = self.class_group(class);
                self.fs.children(&parent).into_iter().filter_map(move |child| {
                    let uid = child.strip_prefix(POD_CGROUP_PREFIX)?.to_owned();
                    Some((uid, format!("{parent}/{child}")))
                })
            })
            .collect()
    }

    /// Removes the group of pod `uid` (wherever it is), in every
    /// hierarchy. Its processes must be gone (the runtime removed the
    /// sandbox); groups the runtime left under it (empty) go first.
    pub fn remove_pod(&self, uid: &str) -> Result<(), CgroupError> {
        if self.settings.driver != CgroupDriver::Cgroupfs {
            return Ok(());
        }
        if self.burstable.lock().unwrap_or_else(|p| p.into_inner()).remove(uid).is_some() {
            self.update_burstable();
        }
        for (owner, group) in self.pod_groups() {
            if owner == uid {
                self.fs.remove_tree(&group)?;
                tracing::info!(pod.uid = %uid, cgroup = %group, "pod cgroup removed");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "p", "uid": "u-1"}, "spec": spec})).expect("pod")
    }

    #[test]
    fn shares_quota_and_weight_follow_upstream() {
        assert_eq!(shares(0), 2);
        assert_eq!(shares(1), 2);
        assert_eq!(shares(250), 256);
        assert_eq!(shares(1000), 1024);
        assert_eq!(shares(1_000_000), MAX_SHARES);
        assert_eq!(quota(0), None);
        assert_eq!(quota(5), Some(MIN_QUOTA));
        assert_eq!(quota(500), Some(50_000));
        assert_eq!(cpu_weight(2), 1);
        assert_eq!(cpu_weight(1024), 39);
        assert_eq!(cpu_weight(MAX_SHARES), 10_000);
    }

    #[test]
    fn pod_limits_follow_the_class() {
        let guaranteed = pod(serde_json::json!({"containers": [
            {"name": "a", "resources": {"limits": {"cpu": "500m", "memory": "64Mi"}}},
            {"name": "b", "resources": {"limits": {"cpu": "250m", "memory": "32Mi"}}},
        ]}));
        assert_eq!(
            pod_resources(&guaranteed, true, Some(100)),
            CgroupResources {
                cpu_shares: Some(768),
                cpu_quota: Some(75_000),
                memory_limit: Some(96 << 20),
                pids_limit: Some(100)
            }
        );
        // Burstable: a memory limit only when every container has one.
        let burstable = pod(serde_json::json!({"containers": [
            {"name": "a", "resources": {"requests": {"cpu": "100m"}, "limits": {"memory": "64Mi"}}},
            {"name": "b"},
        ]}));
        assert_eq!(
            pod_resources(&burstable, true, None),
            CgroupResources { cpu_shares: Some(102), ..CgroupResources::default() }
        );
        let best_effort = pod(serde_json::json!({"containers": [{"name": "a"}]}));
        assert_eq!(
            pod_resources(&best_effort, true, None),
            CgroupResources { cpu_shares: Some(2), ..CgroupResources::default() }
        );
        // Without CFS quotas, limits are unlimited.
        assert_eq!(pod_resources(&guaranteed, false, None).cpu_quota, Some(-1));
    }

    #[test]
    fn init_containers_sidecars_and_overhead_count_as_upstream_counts_them() {
        let with_init = pod(serde_json::json!({
            "overhead": {"cpu": "10m", "memory": "1Mi"},
            "initContainers": [
                {"name": "big", "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "1Gi"}}},
                {"name": "side", "restartPolicy": "Always", "resources": {"requests": {"cpu": "100m"}, "limits": {"memory": "8Mi"}}},
            ],
            "containers": [{"name": "a", "resources": {"requests": {"cpu": "500m"}, "limits": {"memory": "64Mi"}}}],
        }));
        let totals = pod_totals(&with_init);
        // max(500m + 100m sidecar, 2 cpu init) + 10m overhead.
        assert_eq!(totals.cpu_request, 2010);
        assert_eq!(totals.memory_limit, (1 << 30) + (1 << 20));
        assert!(totals.memory_limited);
        assert!(!totals.cpu_limited);
        assert_eq!(totals.cpu_limit, 0, "no cpu limits: overhead is not added");
    }

    /// A v2 tree in a temporary directory: controllers are delegated down,
    /// weights and `cpu.max` written in v2's forms.
    #[test]
    fn v2_groups_are_made_with_delegated_controllers() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("cgroup.controllers"), "cpuset cpu io memory pids").expect("write");
        std::fs::write(dir.path().join("cgroup.subtree_control"), "").expect("write");
        let fs = CgroupFs::detect_at(dir.path()).expect("v2");
        assert_eq!(fs.version(), CgroupVersion::V2);
        // The kernel would make these files; the test makes the first level's.
        std::fs::create_dir(dir.path().join("kubepods")).expect("mkdir");
        std::fs::write(dir.path().join("kubepods/cgroup.controllers"), "cpu memory").expect("write");
        let resources = CgroupResources {
            cpu_shares: Some(1024),
            cpu_quota: Some(-1),
            memory_limit: Some(1 << 20),
            pids_limit: None,
        };
        fs.ensure("/kubepods/podx", &resources).expect("ensure");
        let read = |p: &str| std::fs::read_to_string(dir.path().join(p)).expect("read");
        assert_eq!(read("cgroup.subtree_control"), "+cpu +cpuset +memory +pids");
        assert_eq!(read("kubepods/cgroup.subtree_control"), "+cpu +memory");
        assert_eq!(read("kubepods/podx/cpu.weight"), "39");
        assert_eq!(read("kubepods/podx/cpu.max"), "max 100000");
        assert_eq!(read("kubepods/podx/memory.max"), "1048576");
        std::fs::write(dir.path().join("kubepods/podx/memory.current"), "5000\n").expect("write");
        std::fs::write(dir.path().join("kubepods/podx/memory.stat"), "anon 3000\ninactive_file 1200\n").expect("write");
        assert_eq!(
            fs.memory("/kubepods/podx").expect("memory"),
            MemoryUsage { usage: 5000, working_set: 3800, rss: 3000 }
        );
        assert_eq!(fs.memory_limit("/kubepods/podx"), Some(1 << 20));
        std::fs::write(dir.path().join("kubepods/podx/cpu.stat"), "usage_usec 1500\nuser_usec 1000\n").expect("write");
        assert_eq!(fs.cpu_usage_ns("/kubepods/podx").expect("cpu"), 1_500_000);
    }

    #[test]
    fn systemd_parents_are_slices() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("memory")).expect("mkdir");
        let fs = CgroupFs::detect_at(dir.path()).expect("v1");
        let settings = QosCgroupSettings { driver: CgroupDriver::Systemd, ..QosCgroupSettings::new() };
        let cgroups = PodCgroups::start(fs, settings).expect("start");
        let burstable =
            pod(serde_json::json!({"containers": [{"name": "a", "resources": {"requests": {"cpu": "1"}}}]}));
        assert_eq!(cgroups.cgroup_parent(&burstable), "kubepods-burstable-podu_1.slice");
        assert!(!dir.path().join("memory/kubepods").exists(), "systemd makes slices, not the node");
    }
}
