//! What the node has: cpu and memory measured from the machine, the pod
//! count (`--max-pods`), `ephemeral-storage` (the size of the root dir's
//! file system; nothing reserved, no eviction threshold), the device
//! plugins' resources; and the `v1.Node`
//! object that describes it (what `rustlet get node` prints and cluster mode
//! will register).

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node as NodeObject, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeFeatures, NodeSpec,
    NodeStatus, NodeSystemInfo, Taint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use crate::device_manager::ResourceCapacity;
use crate::health::{ComponentHealth, Healthz};
use crate::pod::Allocatable;

/// The kubelet's default `--max-pods`.
pub const DEFAULT_MAX_PODS: usize = 110;

/// The machine's cpu (millicores, from the cpus this process may run on)
/// and memory (bytes, `MemTotal`), with room for `max_pods` pods. Nothing is
/// reserved for the system: allocatable equals capacity.
pub fn measure(max_pods: usize) -> Allocatable {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u128;
    Allocatable { cpu_milli: cpus * 1000, memory: mem_total().unwrap_or(0), pods: max_pods }
}

fn mem_total() -> Option<u128> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Why a reservation (`--system-reserved`, `--kube-reserved`) was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReservedError {
    /// The value is not a Kubernetes quantity.
    #[error("{name}={value}: not a quantity")]
    NotAQuantity {
        /// The resource.
        name: String,
        /// What was given for it.
        value: String,
    },
    /// Only cpu, memory, ephemeral-storage and pid may be reserved.
    #[error("cannot reserve {0:?} resource")]
    NotReservable(String),
}

/// What one party holds back from pods (`--system-reserved`,
/// `--kube-reserved`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reserved {
    /// Millicores.
    pub cpu_milli: u128,
    /// Bytes of memory.
    pub memory: u128,
    /// Bytes of the root dir's file system.
    pub ephemeral_storage: u128,
    /// Process IDs.
    pub pids: u128,
}

impl Reserved {
    /// Parses `cpu=200m,memory=500Mi,ephemeral-storage=1Gi,pid=1000` (or a
    /// configuration file's map of the same): only those four may be
    /// reserved, as upstream says.
    pub fn parse(map: &BTreeMap<String, String>) -> Result<Reserved, ReservedError> {
        let mut reserved = Reserved::default();
        for (name, value) in map {
            let bad = || ReservedError::NotAQuantity { name: name.clone(), value: value.clone() };
            match name.as_str() {
                "cpu" => reserved.cpu_milli = crate::provider::quantity::parse_milli(value).map_err(|_| bad())?,
                "memory" => reserved.memory = crate::provider::quantity::parse_units(value).map_err(|_| bad())?,
                "ephemeral-storage" => {
                    reserved.ephemeral_storage = crate::provider::quantity::parse_units(value).map_err(|_| bad())?
                }
                "pid" => reserved.pids = crate::provider::quantity::parse_units(value).map_err(|_| bad())?,
                other => return Err(ReservedError::NotReservable(other.to_owned())),
            }
        }
        Ok(reserved)
    }

    /// This and `other` together.
    pub(crate) fn plus(self, other: Reserved) -> Reserved {
        Reserved {
            cpu_milli: self.cpu_milli + other.cpu_milli,
            memory: self.memory + other.memory,
            ephemeral_storage: self.ephemeral_storage + other.ephemeral_storage,
            pids: self.pids + other.pids,
        }
    }
}

/// What the node holds back from pods, as upstream computes allocatable:
/// capacity less system and kube reservations less the hard eviction
/// thresholds of `memory.available` and `nodefs.available`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reservation {
    /// `--system-reserved`.
    pub system: Reserved,
    /// `--kube-reserved`.
    pub kube: Reserved,
    /// The hard `memory.available` threshold.
    pub eviction_memory: Option<crate::eviction::ThresholdValue>,
    /// The hard `nodefs.available` threshold.
    pub eviction_nodefs: Option<crate::eviction::ThresholdValue>,
}

impl Reservation {
    /// What pods may use of `capacity`.
    pub fn allocatable(&self, capacity: Allocatable) -> Allocatable {
        let reserved = self.system.plus(self.kube);
        let eviction = self.eviction_memory.map_or(0, |t| t.amount(capacity.memory));
        Allocatable {
            cpu_milli: capacity.cpu_milli.saturating_sub(reserved.cpu_milli),
            memory: capacity.memory.saturating_sub(reserved.memory).saturating_sub(eviction),
            pods: capacity.pods,
        }
    }

    /// What pods may use of `capacity` bytes of ephemeral storage.
    pub(crate) fn storage(&self, capacity: u128) -> u128 {
        let reserved = self.system.plus(self.kube).ephemeral_storage;
        let eviction = self.eviction_nodefs.map_or(0, |t| t.amount(capacity));
        capacity.saturating_sub(reserved).saturating_sub(eviction)
    }

    /// The `kubepods` group's limits when allocatable is enforced on it
    /// (`--enforce-node-allocatable=pods`): capacity less the system and
    /// kube reservations (not the eviction thresholds: the kernel's limit
    /// stays above the point where the node evicts), cpu as shares (no
    /// quota), process IDs when some are reserved.
    pub fn kubepods(&self, capacity: Allocatable) -> kubelet_support::cgroups::CgroupResources {
        let reserved = self.system.plus(self.kube);
        let pids = (reserved.pids > 0)
            .then(|| crate::eviction::manager::pid_capacity().map(|max| max.saturating_sub(reserved.pids)))
            .flatten()
            .and_then(|p| u64::try_from(p).ok());
        kubelet_support::cgroups::CgroupResources {
            cpu_shares: Some(kubelet_support::cgroups::shares(capacity.cpu_milli.saturating_sub(reserved.cpu_milli))),
            cpu_quota: None,
            memory_limit: u64::try_from(capacity.memory.saturating_sub(reserved.memory)).ok(),
            pids_limit: pids,
        }
    }
}

/// Facts for the Node object.
#[derive(Clone)]
pub(crate) struct NodeFacts<'a> {
    pub(crate) name: &'a str,
    pub(crate) capacity: Allocatable,
    pub(crate) allocatable: Allocatable,
    pub(crate) reservation: &'a Reservation,
    pub(crate) pressure: crate::eviction::pressure::PressureState,
    pub(crate) devices: &'a BTreeMap<String, ResourceCapacity>,
    pub(crate) created: jiff::Timestamp,
    pub(crate) ready: Result<(), String>,
    /// Labels from the provider (over the node's own).
    pub(crate) labels: &'a BTreeMap<String, String>,
    /// Taints from the provider and the command line.
    pub(crate) taints: &'a [Taint],
    /// The node's IPs (`InternalIP` addresses).
    pub(crate) addresses: &'a [IpAddr],
    /// Bytes of the file system holding the root dir, if it can be read.
    pub(crate) ephemeral_storage: Option<u128>,
    /// The kubelet API's port, if it is served.
    pub(crate) kubelet_port: Option<u16>,
    /// The container runtime's name and version (`containerd://1.6.20`).
    pub(crate) runtime_version: &'a str,
    /// Whether the runtime honours `supplementalGroupsPolicy: Strict`
    /// (`status.features.supplementalGroupsPolicy`).
    pub(crate) strict_supplemental_groups: bool,
    /// `status.nodeInfo.kubeletVersion`.
    pub(crate) kubelet_version: &'a str,
}

/// What describes the node besides its devices and health.
#[derive(Clone, Debug)]
pub struct NodeDescription {
    /// The node's name.
    pub name: String,
    /// What the machine has (`status.capacity`).
    pub capacity: Allocatable,
    /// What pods may use of it (`status.allocatable`).
    pub allocatable: Allocatable,
    /// What is held back (for ephemeral storage, measured at each write).
    pub reservation: Reservation,
    /// The node's pressure (`MemoryPressure`, `DiskPressure`, `PIDPressure`).
    pub pressure: crate::eviction::pressure::Pressure,
    /// When the node started (the Node's creation time before it is registered).
    pub created: jiff::Timestamp,
    /// The Node's labels.
    pub labels: BTreeMap<String, String>,
    /// The Node's taints.
    pub taints: Vec<Taint>,
    /// The node's IPs (`InternalIP` addresses).
    pub addresses: Vec<IpAddr>,
    /// The root dir: its file system is the node's `ephemeral-storage`.
    pub root_dir: std::path::PathBuf,
    /// The kubelet API's port (`status.daemonEndpoints`), if it is served.
    pub kubelet_port: Option<u16>,
    /// The container runtime's name, version and features, from the
    /// provider (asked at every status write: a runtime that did not answer
    /// at start shows once it does).
    pub runtime: RuntimeFacts,
    /// The version the Node reports (`status.nodeInfo.kubeletVersion`):
    /// [`crate::VERSION`] until the control plane's `/version` is read, then
    /// [`crate::kubelet_version_for`] it.
    pub kubelet_version: String,
}

/// Where the Node's `containerRuntimeVersion` and `features` come from.
#[derive(Clone, Default)]
pub struct RuntimeFacts(pub Option<std::sync::Arc<dyn crate::provider::Provider>>);

impl RuntimeFacts {
    fn version(&self) -> String {
        self.0.as_ref().map(|p| p.runtime_version()).unwrap_or_default()
    }

    fn strict_supplemental_groups(&self) -> bool {
        self.0.as_ref().is_some_and(|p| p.supports_strict_supplemental_groups())
    }
}

impl std::fmt::Debug for RuntimeFacts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (strict supplemental groups: {})", self.version(), self.strict_supplemental_groups())
    }
}

impl NodeDescription {
    /// The `v1.Node` with these devices, Ready from `healthz`.
    pub fn object(&self, devices: &BTreeMap<String, ResourceCapacity>, healthz: &Healthz) -> NodeObject {
        node_object(&NodeFacts {
            name: &self.name,
            capacity: self.capacity,
            allocatable: self.allocatable,
            reservation: &self.reservation,
            pressure: self.pressure.now(),
            devices,
            created: self.created,
            ready: readiness(healthz),
            labels: &self.labels,
            taints: &self.taints,
            addresses: &self.addresses,
            ephemeral_storage: file_system_size(&self.root_dir),
            kubelet_port: self.kubelet_port,
            runtime_version: &self.runtime.version(),
            strict_supplemental_groups: self.runtime.strict_supplemental_groups(),
            kubelet_version: &self.kubelet_version,
        })
    }
}

use crate::pod::file_system_size;

/// `Ok` when every check passes; otherwise the failing checks, named.
pub(crate) fn readiness(healthz: &Healthz) -> Result<(), String> {
    let failing: Vec<String> = healthz
        .report()
        .into_iter()
        .filter_map(|c| match c.health {
            ComponentHealth::Healthy => None,
            ComponentHealth::Failing { reason } => Some(format!("{} failed: {reason}", c.name)),
        })
        .collect();
    if failing.is_empty() { Ok(()) } else { Err(failing.join("; ")) }
}

/// The pressure conditions (upstream's reasons and messages), then Ready.
fn conditions(facts: &NodeFacts<'_>, status: &str, reason: &str, message: String, now: &Time) -> Vec<NodeCondition> {
    let mut conditions: Vec<NodeCondition> = crate::eviction::pressure::CONDITION_TEXTS
        .iter()
        .filter(|(type_, on, _, _)| facts.pressure.conditions().contains(type_) == *on)
        .map(|(type_, on, reason, message)| NodeCondition {
            type_: (*type_).into(),
            status: if *on { "True" } else { "False" }.into(),
            reason: Some((*reason).into()),
            message: Some((*message).into()),
            last_heartbeat_time: Some(now.clone()),
            last_transition_time: Some(now.clone()),
        })
        .collect();
    conditions.push(NodeCondition {
        type_: "Ready".into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(now.clone()),
    });
    conditions
}

/// The annotation by which a node leaves attaching and detaching its
/// volumes to the controller-manager's attach/detach controller (which then
/// lists them in `status.volumesAttached` once their VolumeAttachments are
/// attached), as the kubelet sets it by default
/// (`--enable-controller-attach-detach`); a node without it is not
/// managed by that controller.
pub(crate) const CONTROLLER_MANAGED_ATTACH_DETACH: &str = "volumes.kubernetes.io/controller-managed-attach-detach";

/// The node as a `v1.Node`: capacity and allocatable (device resources
/// included), a `Ready` condition from the health checks, node info.
pub(crate) fn node_object(facts: &NodeFacts<'_>) -> NodeObject {
    let mut capacity = BTreeMap::new();
    let mut allocatable = BTreeMap::new();
    for (map, amounts, storage) in [
        (&mut capacity, facts.capacity, facts.ephemeral_storage),
        (&mut allocatable, facts.allocatable, facts.ephemeral_storage.map(|b| facts.reservation.storage(b))),
    ] {
        map.insert("cpu".to_owned(), Quantity(format_cpu(amounts.cpu_milli)));
        map.insert("memory".to_owned(), Quantity(format!("{}Ki", amounts.memory / 1024)));
        map.insert("pods".to_owned(), Quantity(amounts.pods.to_string()));
        if let Some(bytes) = storage {
            // Upstream writes storage as a plain byte count when it is
            // not a whole number of KiB.
            let text = if bytes % 1024 == 0 { format!("{}Ki", bytes / 1024) } else { bytes.to_string() };
            map.insert("ephemeral-storage".to_owned(), Quantity(text));
        }
    }
    for (resource, counts) in facts.devices {
        capacity.insert(resource.clone(), Quantity(counts.capacity.to_string()));
        allocatable.insert(resource.clone(), Quantity(counts.allocatable.to_string()));
    }
    let now = Time(jiff::Timestamp::now());
    let (status, reason, message) = match &facts.ready {
        Ok(()) => ("True", "KubeletReady", "rustlet is posting ready status".to_owned()),
        Err(why) => ("False", "KubeletNotReady", why.clone()),
    };
    let mut labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_owned(), facts.name.to_owned()),
        ("kubernetes.io/os".to_owned(), std::env::consts::OS.to_owned()),
        ("kubernetes.io/arch".to_owned(), go_arch().to_owned()),
        ("type".to_owned(), "rustlet".to_owned()),
    ]);
    labels.extend(facts.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
    // The deprecated beta labels follow the current ones (the provider's
    // arch included), as the kubelet still writes them.
    for (beta, current) in
        [("beta.kubernetes.io/os", "kubernetes.io/os"), ("beta.kubernetes.io/arch", "kubernetes.io/arch")]
    {
        if let Some(value) = labels.get(current).cloned() {
            labels.insert(beta.to_owned(), value);
        }
    }
    let uname = |file: &str| std::fs::read_to_string(format!("/proc/sys/kernel/{file}")).map(|s| s.trim().to_owned());
    NodeObject {
        metadata: ObjectMeta {
            name: Some(facts.name.to_owned()),
            creation_timestamp: Some(Time(facts.created)),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([(CONTROLLER_MANAGED_ATTACH_DETACH.to_owned(), "true".to_owned())])),
            ..ObjectMeta::default()
        },
        spec: (!facts.taints.is_empty())
            .then(|| NodeSpec { taints: Some(facts.taints.to_vec()), ..NodeSpec::default() }),
        status: Some(NodeStatus {
            capacity: Some(capacity),
            allocatable: Some(allocatable),
            conditions: Some(conditions(facts, status, reason, message, &now)),
            node_info: Some(NodeSystemInfo {
                architecture: go_arch().into(),
                operating_system: std::env::consts::OS.into(),
                kernel_version: uname("osrelease").unwrap_or_default(),
                os_image: os_image(),
                kubelet_version: facts.kubelet_version.to_owned(),
                kube_proxy_version: String::new(),
                container_runtime_version: if facts.runtime_version.is_empty() {
                    format!("rustlet://{}", env!("CARGO_PKG_VERSION"))
                } else {
                    facts.runtime_version.to_owned()
                },
                machine_id: std::fs::read_to_string("/etc/machine-id").map(|s| s.trim().to_owned()).unwrap_or_default(),
                boot_id: uname("random/boot_id").unwrap_or_default(),
                // As upstream: the firmware's product UUID, where it can be read.
                system_uuid: std::fs::read_to_string("/sys/class/dmi/id/product_uuid")
                    .map(|s| s.trim().to_owned())
                    .unwrap_or_default(),
                ..NodeSystemInfo::default()
            }),
            addresses: Some(addresses(facts)),
            // As the kubelet with `SupplementalGroupsPolicy` on (beta, the
            // default, since 1.33): the runtime's word, false when it says
            // nothing.
            features: Some(NodeFeatures { supplemental_groups_policy: Some(facts.strict_supplemental_groups) }),
            daemon_endpoints: facts
                .kubelet_port
                .map(|port| NodeDaemonEndpoints { kubelet_endpoint: Some(DaemonEndpoint { port: i32::from(port) }) }),
            ..NodeStatus::default()
        }),
    }
}

/// `InternalIP` per node IP, then `Hostname`, as the kubelet lists them.
fn addresses(facts: &NodeFacts<'_>) -> Vec<NodeAddress> {
    let mut addresses: Vec<NodeAddress> =
        facts.addresses.iter().map(|ip| NodeAddress { type_: "InternalIP".into(), address: ip.to_string() }).collect();
    addresses.push(NodeAddress { type_: "Hostname".into(), address: facts.name.to_owned() });
    addresses
}

fn format_cpu(milli: u128) -> String {
    if milli.is_multiple_of(1000) { (milli / 1000).to_string() } else { format!("{milli}m") }
}

/// The architecture as Kubernetes names it (Go's `GOARCH`).
fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        other => other,
    }
}

fn os_image() -> String {
    let release = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    release
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_is_measured() {
        let measured = measure(DEFAULT_MAX_PODS);
        assert!(measured.cpu_milli >= 1000 && measured.cpu_milli.is_multiple_of(1000));
        assert!(measured.memory > 64 << 20, "MemTotal read: {}", measured.memory);
        assert_eq!(measured.pods, 110);
    }

    #[test]
    fn reservations_parse_as_upstream_and_kubepods_gets_capacity_less_them() {
        let map = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        let system = Reserved::parse(&map(&[("cpu", "200m"), ("memory", "500Mi"), ("pid", "1000")])).expect("ok");
        assert_eq!((system.cpu_milli, system.memory, system.pids), (200, 500 << 20, 1000));
        let refused = Reserved::parse(&map(&[("nvidia.com/gpu", "1")])).expect_err("not reservable");
        assert_eq!(refused, ReservedError::NotReservable("nvidia.com/gpu".into()));
        assert_eq!(refused.to_string(), "cannot reserve \"nvidia.com/gpu\" resource");
        assert_eq!(
            Reserved::parse(&map(&[("memory", "lots")])).map_err(|e| e.to_string()),
            Err("memory=lots: not a quantity".into())
        );
        let reservation = Reservation {
            system,
            eviction_memory: Some(crate::eviction::ThresholdValue::Quantity(100 << 20)),
            ..Reservation::default()
        };
        let capacity = Allocatable { cpu_milli: 2000, memory: 4 << 30, pods: 110 };
        let kubepods = reservation.kubepods(capacity);
        assert_eq!(kubepods.memory_limit, Some((4 << 30) - (500 << 20)), "eviction thresholds stay out of the limit");
        assert_eq!(kubepods.cpu_shares, Some(1843));
        assert_eq!(kubepods.cpu_quota, None);
        assert!(kubepods.pids_limit.is_some_and(|p| p > 0));
        assert_eq!(reservation.allocatable(capacity).memory, (4 << 30) - (600 << 20));
        assert_eq!(Reservation::default().storage(1000), 1000);
    }

    #[test]
    fn the_reported_version_is_the_newest_conformed_one_the_control_plane_accepts() {
        let release = |major: &str, minor: &str| {
            let version = crate::kubelet_version_for(major, minor);
            version.split('+').next().unwrap_or_default().to_owned()
        };
        assert_eq!(release("1", "33"), "v1.33.3");
        assert_eq!(release("1", "35"), "v1.33.3", "a newer control plane takes an older kubelet");
        assert_eq!(release("1", "32"), "v1.28.7", "never newer than the API server");
        assert_eq!(release("1", "28"), "v1.28.7");
        assert_eq!(release("1", "30+"), "v1.28.7", "a provider's minor such as 30+");
        assert_eq!(release("1", "27"), "v1.28.7", "older than all: the oldest");
        assert_eq!(release("", ""), "v1.33.3", "unknown: the newest");
        assert!(crate::kubelet_version_for("1", "33").ends_with(concat!("+rustlet.", env!("CARGO_PKG_VERSION"))));
    }

    #[test]
    fn the_node_object_carries_devices_and_readiness() {
        let devices =
            BTreeMap::from([("example.com/gpu".to_owned(), ResourceCapacity { capacity: 4, allocatable: 3 })]);
        let capacity = Allocatable { cpu_milli: 2500, memory: 4 << 30, pods: 10 };
        let reservation = Reservation {
            system: Reserved { cpu_milli: 500, memory: 1 << 30, ..Reserved::default() },
            kube: Reserved { memory: 512 << 20, ephemeral_storage: 1 << 20, ..Reserved::default() },
            eviction_memory: Some(crate::eviction::ThresholdValue::Quantity(100 << 20)),
            eviction_nodefs: Some(crate::eviction::ThresholdValue::Percentage(0.1)),
        };
        let facts = NodeFacts {
            name: "n1",
            capacity,
            allocatable: reservation.allocatable(capacity),
            reservation: &reservation,
            pressure: crate::eviction::pressure::PressureState { disk: true, ..Default::default() },
            devices: &devices,
            created: jiff::Timestamp::now(),
            ready: Err("plugin-manager failed: boom".into()),
            labels: &BTreeMap::from([("kubernetes.io/arch".to_owned(), "wasm32-wasi".to_owned())]),
            taints: &[Taint {
                key: "kubernetes.io/arch".into(),
                value: Some("wasm32-wasi".into()),
                effect: "NoExecute".into(),
                time_added: None,
            }],
            addresses: &["10.1.2.3".parse().expect("ip")],
            ephemeral_storage: file_system_size(std::path::Path::new("/")),
            kubelet_port: Some(10250),
            runtime_version: "containerd://1.6.20",
            strict_supplemental_groups: false,
            kubelet_version: &crate::kubelet_version_for("1", "33"),
        };
        let node = node_object(&facts);
        let features = node.status.as_ref().and_then(|s| s.features.clone()).expect("features");
        assert_eq!(features.supplemental_groups_policy, Some(false), "a runtime that says nothing supports nothing");
        let strict = node_object(&NodeFacts { strict_supplemental_groups: true, ..facts.clone() });
        let features = strict.status.and_then(|s| s.features).and_then(|f| f.supplemental_groups_policy);
        assert_eq!(features, Some(true));
        let info = node.status.as_ref().and_then(|s| s.node_info.clone()).expect("node info");
        assert_eq!(info.container_runtime_version, "containerd://1.6.20");
        assert!(info.kubelet_version.starts_with("v1.33.3+rustlet."), "{}", info.kubelet_version);
        let labels = node.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels["kubernetes.io/arch"], "wasm32-wasi", "the provider's label wins");
        assert_eq!(labels["kubernetes.io/hostname"], "n1");
        assert_eq!(labels["beta.kubernetes.io/arch"], "wasm32-wasi");
        assert_eq!(labels["beta.kubernetes.io/os"], "linux");
        let annotations = node.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(
            annotations.get(CONTROLLER_MANAGED_ATTACH_DETACH).map(String::as_str),
            Some("true"),
            "attaching is left to the attach/detach controller, as the kubelet's default"
        );
        let taints = node.spec.clone().and_then(|s| s.taints).unwrap_or_default();
        assert_eq!(taints.len(), 1);
        let status = node.status.expect("status");
        let port = status.daemon_endpoints.as_ref().and_then(|d| d.kubelet_endpoint.as_ref()).map(|e| e.port);
        assert_eq!(port, Some(10250), "the kubelet API is advertised");
        let capacity = status.capacity.expect("capacity");
        assert_eq!(capacity["cpu"].0, "2500m");
        assert_eq!(capacity["memory"].0, "4194304Ki");
        let allocatable = status.allocatable.clone().expect("allocatable");
        assert_eq!(allocatable["cpu"].0, "2");
        assert_eq!(allocatable["memory"].0, format!("{}Ki", (4 << 20) - (1 << 20) - (512 << 10) - (100 << 10)));
        assert_eq!(capacity["example.com/gpu"].0, "4");
        let storage = capacity["ephemeral-storage"].0.trim_end_matches("Ki").parse::<u64>().expect("KiB");
        assert!(storage > 0, "the root file system has a size");
        assert_eq!(status.allocatable.expect("allocatable")["example.com/gpu"].0, "3");
        let addresses = status.addresses.clone().unwrap_or_default();
        assert_eq!((addresses[0].type_.as_str(), addresses[0].address.as_str()), ("InternalIP", "10.1.2.3"));
        assert_eq!((addresses[1].type_.as_str(), addresses[1].address.as_str()), ("Hostname", "n1"));
        let conditions = status.conditions.expect("conditions");
        let of = |type_: &str| conditions.iter().find(|c| c.type_ == type_).expect("condition");
        let ready = of("Ready");
        assert_eq!((ready.status.as_str(), ready.message.as_deref()), ("False", Some("plugin-manager failed: boom")));
        let disk = of("DiskPressure");
        assert_eq!((disk.status.as_str(), disk.reason.as_deref()), ("True", Some("KubeletHasDiskPressure")));
        let memory = of("MemoryPressure");
        assert_eq!(
            (memory.status.as_str(), memory.message.as_deref()),
            ("False", Some("kubelet has sufficient memory available"))
        );
        assert_eq!(of("PIDPressure").reason.as_deref(), Some("KubeletHasSufficientPID"));
    }
}
