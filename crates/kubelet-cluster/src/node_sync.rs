//! The node's own objects in the cluster: the `Node` (created, or adopted
//! when one of the same name exists; created again if an administrator
//! deletes it), its status, and its `Lease` heartbeat in `kube-node-lease`.
//!
//! - The status is a merge patch of the whole `status` (capacity,
//!   allocatable, conditions with heartbeat times, node info). It is sent
//!   when what the node reports changes (changes arriving together are
//!   coalesced into one patch; a token bucket keeps a node that changes
//!   without pause, such as a device plugin flapping health, to
//!   `patch_burst + patches_per_minute` patches a minute, 60 by default)
//!   and at least every `report_interval` (upstream's
//!   `nodeStatusReportFrequency`, 5 min). A failed patch is retried with
//!   backoff and counted; nothing panics.
//! - A condition keeps its `lastTransitionTime` while its status stays.
//! - The lease is renewed every `renew_interval` (10 s, a quarter of its 40
//!   s duration) plus up to 4% at random (upstream's jitter), holder = the
//!   node name, owned by the Node.
//! - Deletion of the Node is seen through a watch on it (event-driven, no
//!   poll) and answered by creating it again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, NodeCondition};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference, Time};
use kube::api::{Api, Patch};
use kube::runtime::watcher;
use serde_json::json;
use tokio::sync::{Notify, watch};

use super::{Supervision, describe, is_code};
use crate::health::{HealthCheck, HealthReporter};
use crate::retry::RetryBackoff;

/// How much a renewal period is stretched at random (upstream's lease
/// controller: `wait.JitterUntil(…, 0.04, …)`).
const LEASE_JITTER: f64 = 0.04;

/// The namespace of node leases.
pub const LEASE_NAMESPACE: &str = "kube-node-lease";

/// Timings of the node's writes.
#[derive(Debug, Clone)]
pub struct NodeSyncConfig {
    /// The node's name.
    pub node_name: String,
    /// `leaseDurationSeconds` (upstream: 40 s).
    pub lease_duration: Duration,
    /// How often the lease is renewed (upstream: a quarter of the duration).
    pub renew_interval: Duration,
    /// The longest time between two status patches (upstream: 5 min).
    pub report_interval: Duration,
    /// How long changes are gathered into one patch.
    pub coalesce: Duration,
    /// Status patches allowed in a burst (a quiet node's change is sent at
    /// once).
    pub patch_burst: u32,
    /// Status patches a minute beyond the burst: with the burst, no minute
    /// holds more than `patch_burst + patches_per_minute` patches however
    /// fast the node changes (a device plugin flapping health, say); the
    /// latest state is what is sent.
    pub patches_per_minute: u32,
    /// The first retry delay after a failure (doubling up to `retry_max`).
    pub retry_initial: Duration,
    /// The longest retry delay.
    pub retry_max: Duration,
    /// Where node events go (`Starting`, `NodeReady`, …); by default they
    /// are only logged.
    pub events: crate::events::EventRecorder,
}

impl NodeSyncConfig {
    /// Upstream's timings for node `node_name`.
    pub fn new(node_name: &str) -> NodeSyncConfig {
        NodeSyncConfig {
            node_name: node_name.to_owned(),
            lease_duration: Duration::from_secs(40),
            renew_interval: Duration::from_secs(10),
            report_interval: Duration::from_secs(300),
            coalesce: Duration::from_millis(20),
            patch_burst: 5,
            patches_per_minute: 55,
            retry_initial: Duration::from_millis(200),
            retry_max: Duration::from_secs(10),
            events: crate::events::EventRecorder::log_only(),
        }
    }
}

/// A token bucket: `burst` tokens, refilled at `per_minute`.
struct Bucket {
    tokens: f64,
    burst: f64,
    per_second: f64,
    last: tokio::time::Instant,
}

impl Bucket {
    fn new(burst: u32, per_minute: u32) -> Bucket {
        let burst = f64::from(burst.max(1));
        Bucket {
            tokens: burst,
            burst,
            per_second: f64::from(per_minute.max(1)) / 60.0,
            last: tokio::time::Instant::now(),
        }
    }

    /// Takes a token, first waiting until there is one.
    async fn take(&mut self) {
        let now = tokio::time::Instant::now();
        self.tokens = (self.tokens + (now - self.last).as_secs_f64() * self.per_second).min(self.burst);
        self.last = now;
        if self.tokens < 1.0 {
            let wait = Duration::from_secs_f64((1.0 - self.tokens) / self.per_second);
            tokio::time::sleep(wait).await;
            self.tokens = 1.0;
            self.last = tokio::time::Instant::now();
        }
        self.tokens -= 1.0;
    }
}

/// Counters of what the sync did.
#[derive(Debug, Default)]
pub struct NodeSyncStats {
    /// Node objects created (1, plus one per recreation).
    pub registrations: AtomicU64,
    /// Status patches that succeeded.
    pub status_patches: AtomicU64,
    /// API calls that failed (and were retried).
    pub failures: AtomicU64,
    /// Lease renewals that succeeded (creation included).
    pub lease_renewals: AtomicU64,
}

/// A running node sync.
#[derive(Debug, Clone)]
pub struct NodeSync {
    stats: Arc<NodeSyncStats>,
    registered: watch::Receiver<Option<String>>,
    health: HealthReporter,
}

impl NodeSync {
    /// What it did so far.
    pub fn stats(&self) -> &NodeSyncStats {
        &self.stats
    }

    /// The UID of the Node object once it is registered (changes when it
    /// is created again).
    pub fn registered(&self) -> watch::Receiver<Option<String>> {
        self.registered.clone()
    }

    /// Failing (with the API's answer) while the Node cannot be registered
    /// or its status cannot be patched; healthy once a call succeeds.
    pub fn health(&self) -> HealthCheck {
        self.health.check()
    }
}

/// The retry backoff of the Node and Lease writes.
fn backoff(config: &NodeSyncConfig) -> RetryBackoff {
    RetryBackoff::new(config.retry_initial, config.retry_max)
}

/// Starts keeping the Node (as `desired` describes it) and its Lease in
/// the cluster, until `shutdown`.
pub fn start(
    client: kube::Client,
    config: NodeSyncConfig,
    desired: watch::Receiver<Node>,
    supervision: impl Into<Supervision>,
) -> NodeSync {
    start_with_heartbeat(client.clone(), client, config, desired, supervision)
}

/// [`start`], with the Node's registration and status and the Lease
/// written through `heartbeat` (a client of their own, so that they never
/// wait behind the node's other requests) and the Node watched through
/// `client`.
pub(crate) fn start_with_heartbeat(
    client: kube::Client,
    heartbeat: kube::Client,
    config: NodeSyncConfig,
    desired: watch::Receiver<Node>,
    supervision: impl Into<Supervision>,
) -> NodeSync {
    let supervision = supervision.into();
    let stats = Arc::new(NodeSyncStats::default());
    let (registered_tx, registered) = watch::channel(None);
    let deleted = Arc::new(Notify::new());
    let health = HealthReporter::new();
    let sync = StatusSync {
        health: health.clone(),
        nodes: Api::all(heartbeat.clone()),
        config: config.clone(),
        desired,
        stats: stats.clone(),
        registered: Arc::new(registered_tx),
        deleted: deleted.clone(),
        conditions: BTreeMap::new(),
        resources: std::collections::BTreeSet::new(),
    };
    supervision.spawn("cluster-node-status", move || sync.clone().run());
    let (watch_client, watch_name, watch_registered) = (client.clone(), config.node_name.clone(), registered.clone());
    supervision.spawn("cluster-node-watch", move || {
        watch_deletion(watch_client.clone(), watch_name.clone(), deleted.clone(), watch_registered.clone())
    });
    let lease = LeaseSync {
        leases: Api::namespaced(heartbeat, LEASE_NAMESPACE),
        config,
        stats: stats.clone(),
        registered: registered.clone(),
        last: None,
    };
    supervision.spawn("cluster-node-lease", move || lease.clone().run());
    NodeSync { stats, registered, health }
}

#[derive(Clone)]
struct StatusSync {
    nodes: Api<Node>,
    config: NodeSyncConfig,
    desired: watch::Receiver<Node>,
    stats: Arc<NodeSyncStats>,
    registered: Arc<watch::Sender<Option<String>>>,
    deleted: Arc<Notify>,
    health: HealthReporter,
    /// The conditions last sent, by type: their transition times are kept
    /// while their status stays.
    conditions: BTreeMap<String, NodeCondition>,
    /// Every resource ever sent: one the node no longer reports (a device
    /// plugin gone past its grace period) is sent as 0, as upstream does (a
    /// merge patch would otherwise leave its last value).
    resources: std::collections::BTreeSet<String>,
}

impl StatusSync {
    async fn run(mut self) {
        let mut backoff = backoff(&self.config);
        loop {
            let uid = loop {
                match self.register().await {
                    Ok(uid) => break uid,
                    Err(error) => {
                        self.stats.failures.fetch_add(1, Ordering::Relaxed);
                        let delay = backoff.next_delay();
                        let error = describe(&error);
                        self.health.failing(format!("cannot register node {}: {error}", self.config.node_name));
                        tracing::warn!(node = %self.config.node_name, %error, retry_in = ?delay, "cannot register the node; retrying");
                        tokio::time::sleep(delay).await;
                    }
                }
            };
            backoff.reset();
            self.health.healthy();
            let _ = self.registered.send(Some(uid));
            self.keep_status(&mut backoff).await;
            // The node is gone: register it again.
        }
    }

    /// Creates the Node, or adopts the existing one; returns its UID.
    async fn register(&mut self) -> Result<String, kube::Error> {
        let mut node = self.desired.borrow().clone();
        node.metadata.creation_timestamp = None;
        node.metadata.resource_version = None;
        node.metadata.uid = None;
        self.stamp(&mut node);
        let name = &self.config.node_name;
        match self.nodes.create(&super::post_params(), &node).await {
            Ok(created) => {
                self.stats.registrations.fetch_add(1, Ordering::Relaxed);
                tracing::info!(node = %name, "node registered");
                // A new object's status may have been reset: send it.
                self.patch_status().await?;
                Ok(created.metadata.uid.unwrap_or_default())
            }
            Err(error) if is_code(&error, 409) => {
                // Adopt it: our labels and annotations over its own (the
                // attach/detach controller's annotation included, as the
                // kubelet reconciles it on an existing Node), then the status.
                let labels = node.metadata.labels.clone().unwrap_or_default();
                let annotations = node.metadata.annotations.clone().unwrap_or_default();
                let patch = json!({"metadata": {"labels": labels, "annotations": annotations}});
                let adopted = self.nodes.patch(name, &super::patch_params(), &Patch::Merge(&patch)).await?;
                tracing::info!(node = %name, "node object exists; adopted it");
                self.patch_status().await?;
                Ok(adopted.metadata.uid.unwrap_or_default())
            }
            Err(error) => Err(error),
        }
    }

    /// Resources sent before and no longer reported become 0.
    fn zero_gone_resources(&mut self, node: &mut Node) {
        let Some(status) = node.status.as_mut() else { return };
        for map in [&mut status.capacity, &mut status.allocatable] {
            let map = map.get_or_insert_with(BTreeMap::new);
            for name in &self.resources {
                map.entry(name.clone()).or_insert_with(|| Quantity("0".into()));
            }
            self.resources.extend(map.keys().cloned());
        }
    }

    /// Sets heartbeat times, and transition times where a status changed.
    fn stamp(&mut self, node: &mut Node) {
        let now = Time(jiff::Timestamp::now());
        let Some(conditions) = node.status.as_mut().and_then(|s| s.conditions.as_mut()) else { return };
        for condition in conditions.iter_mut() {
            condition.last_heartbeat_time = Some(now.clone());
            let previous = self.conditions.get(&condition.type_);
            if previous.is_none_or(|p| p.status != condition.status)
                && let Some(event) = condition_event(&condition.type_, condition.status == "True")
            {
                let message = format!("Node {} status is now: {event}", self.config.node_name);
                self.config.events.node(&self.config.node_name, crate::events::EventType::Normal, event, message);
            }
            let kept = previous
                .filter(|previous| previous.status == condition.status)
                .and_then(|previous| previous.last_transition_time.clone());
            condition.last_transition_time = Some(kept.unwrap_or_else(|| now.clone()));
            self.conditions.insert(condition.type_.clone(), condition.clone());
        }
    }

    async fn patch_status(&mut self) -> Result<(), kube::Error> {
        let mut node = self.desired.borrow_and_update().clone();
        self.stamp(&mut node);
        self.zero_gone_resources(&mut node);
        let mut status = serde_json::to_value(&node.status).unwrap_or_default();
        // A strategic merge patch: conditions merge by type, so conditions
        // other writers own (NetworkUnavailable, node-problem-detector's)
        // stay; the addresses are replaced whole (merging them by type
        // would fold two InternalIPs into one).
        if let Some(addresses) = status.get_mut("addresses").and_then(|a| a.as_array_mut()) {
            addresses.push(json!({"$patch": "replace"}));
        }
        let patch = json!({"status": status});
        self.nodes.patch_status(&self.config.node_name, &super::patch_params(), &Patch::Strategic(&patch)).await?;
        self.stats.status_patches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Patches the status on changes and at the report interval until the
    /// node is found gone.
    async fn keep_status(&mut self, backoff: &mut RetryBackoff) {
        let mut due = false;
        let mut bucket = Bucket::new(self.config.patch_burst, self.config.patches_per_minute);
        loop {
            if !due {
                tokio::select! {
                    changed = self.desired.changed() => {
                        if changed.is_err() {
                            // The node is stopping.
                            std::future::pending::<()>().await;
                        }
                        // Let changes that come together make one patch.
                        tokio::time::sleep(self.config.coalesce).await;
                    }
                    () = tokio::time::sleep(self.config.report_interval) => {}
                    () = self.deleted.notified() => {
                        tracing::warn!(node = %self.config.node_name, "node object deleted; registering it again");
                        return;
                    }
                }
            }
            // At most the bucket's rate: changes meanwhile are in the
            // state sent when a token comes.
            tokio::select! {
                () = bucket.take() => {}
                () = self.deleted.notified() => {
                    tracing::warn!(node = %self.config.node_name, "node object deleted; registering it again");
                    return;
                }
            }
            match self.patch_status().await {
                Ok(()) => {
                    backoff.reset();
                    self.health.healthy();
                    due = false;
                }
                Err(error) if is_code(&error, 404) => {
                    tracing::warn!(node = %self.config.node_name, "node object gone; registering it again");
                    return;
                }
                Err(error) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    let delay = backoff.next_delay();
                    let error = describe(&error);
                    self.health.failing(format!("cannot patch the status of node {}: {error}", self.config.node_name));
                    tracing::warn!(node = %self.config.node_name, %error, retry_in = ?delay, "node status patch failed; retrying");
                    due = true;
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = self.deleted.notified() => return,
                    }
                }
            }
        }
    }
}

/// Upstream's node event for condition `type_` becoming `status`.
fn condition_event(type_: &str, status: bool) -> Option<&'static str> {
    Some(match (type_, status) {
        ("Ready", true) => "NodeReady",
        ("Ready", false) => "NodeNotReady",
        ("MemoryPressure", false) => "NodeHasSufficientMemory",
        ("MemoryPressure", true) => "NodeHasInsufficientMemory",
        ("DiskPressure", false) => "NodeHasNoDiskPressure",
        ("DiskPressure", true) => "NodeHasDiskPressure",
        ("PIDPressure", false) => "NodeHasSufficientPID",
        ("PIDPressure", true) => "NodeHasInsufficientPID",
        _ => return None,
    })
}

/// Wakes `deleted` when the registered Node object goes (or is missing
/// after a relist).
async fn watch_deletion(
    client: kube::Client,
    name: String,
    deleted: Arc<Notify>,
    registered: watch::Receiver<Option<String>>,
) {
    let nodes: Api<Node> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    // Quiet: a missed deletion is seen again when the watch lists.
    let mut events = crate::mirror::watch_events(nodes, config, "node deletion", crate::mirror::Noise::Quiet);
    let mut seen_in_list = false;
    while let Some(event) = events.next().await {
        match event {
            // Only the object this node registered counts: before the
            // first registration, a missing node is not news.
            watcher::Event::Delete(node) if node.metadata.uid == *registered.borrow() => deleted.notify_one(),
            watcher::Event::Init => seen_in_list = false,
            watcher::Event::InitApply(_) => seen_in_list = true,
            watcher::Event::InitDone if !seen_in_list && registered.borrow().is_some() => deleted.notify_one(),
            _ => {}
        }
    }
}

/// How long one Lease renewal may take: three quarters of the renew
/// interval (at least a second), so that a hung request is given up in
/// time for the next renewal, well within the lease's duration.
fn renewal_deadline(config: &NodeSyncConfig) -> Duration {
    (config.renew_interval * 3 / 4).max(Duration::from_secs(1))
}

#[derive(Clone)]
struct LeaseSync {
    leases: Api<Lease>,
    config: NodeSyncConfig,
    stats: Arc<NodeSyncStats>,
    registered: watch::Receiver<Option<String>>,
    /// The lease as the last write left it: the next renewal replaces it
    /// with one request (its resourceVersion the precondition); after a
    /// failure it is read again first.
    last: Option<Lease>,
}

impl LeaseSync {
    async fn run(mut self) {
        let mut backoff = backoff(&self.config);
        loop {
            // The lease is owned by the Node: wait until it exists.
            let uid = match self.registered.wait_for(Option::is_some).await {
                Ok(uid) => uid.clone().unwrap_or_default(),
                Err(_) => return,
            };
            // A renewal that hangs (an API server that accepted the
            // connection and answers nothing) must not hold the next one
            // back: it has until the next renewal is due.
            let deadline = renewal_deadline(&self.config);
            let renewed = match tokio::time::timeout(deadline, self.renew(&uid)).await {
                Ok(renewed) => renewed.map_err(|error| describe(&error)),
                Err(_) => {
                    self.last = None;
                    Err(format!("no answer within {deadline:?}"))
                }
            };
            let delay = match renewed {
                Ok(()) => {
                    self.stats.lease_renewals.fetch_add(1, Ordering::Relaxed);
                    backoff.reset();
                    // Upstream's lease controller jitters each period by
                    // up to 4%.
                    crate::retry::jittered(self.config.renew_interval, LEASE_JITTER)
                }
                Err(error) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    let delay = backoff.next_delay().min(self.config.renew_interval);
                    tracing::warn!(node = %self.config.node_name, %error, retry_in = ?delay, "cannot renew the node lease; retrying");
                    delay
                }
            };
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                // A new Node object: its lease must name it at once.
                _ = self.registered.changed() => {}
            }
        }
    }

    async fn renew(&mut self, node_uid: &str) -> Result<(), kube::Error> {
        let name = &self.config.node_name;
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: name.clone(),
            uid: node_uid.to_owned(),
            ..OwnerReference::default()
        };
        let spec = LeaseSpec {
            holder_identity: Some(name.clone()),
            lease_duration_seconds: Some(i32::try_from(self.config.lease_duration.as_secs()).unwrap_or(40)),
            renew_time: Some(MicroTime(jiff::Timestamp::now())),
            ..LeaseSpec::default()
        };
        let known = match self.last.take() {
            Some(lease) => Some(lease),
            None => self.leases.get_opt(name).await?,
        };
        match known {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(LEASE_NAMESPACE.into()),
                        owner_references: Some(vec![owner]),
                        ..ObjectMeta::default()
                    },
                    spec: Some(spec),
                };
                self.last = Some(self.leases.create(&super::post_params(), &lease).await?);
            }
            Some(mut lease) => {
                lease.spec = Some(spec);
                lease.metadata.owner_references = Some(vec![owner]);
                // The version known is a precondition: on a conflict (or
                // any failure) the next try reads the lease again.
                self.last = Some(self.leases.replace(name, &super::post_params(), &lease).await?);
            }
        }
        Ok(())
    }
}
