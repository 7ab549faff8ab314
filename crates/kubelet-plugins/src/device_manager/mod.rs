//! The device-plugin manager: device plugins register, stream their devices
//! and health, and the node's extended-resource capacity follows; pods'
//! containers are allocated devices, which are checkpointed.
//!
//! # Flow
//! ```text
//! plugin ──Register──▶ kubelet.sock (registration_server)  ─┐
//! plugins_registry/ ──▶ plugin manager ──▶ DevicePluginHandler ─┤
//!                                                              ▼
//!        endpoint: dial <socket> → GetDevicePluginOptions
//!          → ListAndWatch (stream task per endpoint, replaces any older one)
//!                                                              ▼
//!        device sets per resource ──▶ capacity watch (coalesced snapshots)
//!                                 └─▶ capacity change record (every change, in order)
//!
//! pod lifecycle ──allocate_pod──▶ allocate (flow) ──▶ allocations (index) ──▶ writer ──▶ checkpoint
//!               ──container_run_options──▶ container_start (PreStartContainer, run options)
//!               ──retain_pods / free_pod──▶ allocations ──▶ writer
//! ```
//!
//! # Files
//! - `registration_server`: `kubelet.sock`, rebound when removed, with backoff.
//! - `handler`: plugins registering through `plugins_registry`.
//! - `endpoint`: a plugin's connection, stream, replacement and grace period.
//! - `devices`, `resource_name`: our device types and name rules.
//! - `allocate`: the allocation flow; `allocations`: the index it works on;
//!   `device_choice`: which devices a container gets (pure logic).
//! - `container_start`: `PreStartContainer` and run options at each start.
//! - `run_options`: what a container gets from its devices, merged.
//! - `checkpoint`: the file format; `writer`: the thread that writes it.
//! - `metrics`, `error`.
//!
//! # Guarantees
//! - `Register` answers only once the plugin is connected and its stream open.
//! - A second registration of a resource replaces the first cleanly: the old
//!   stream task is cancelled, its late messages are ignored (generations),
//!   and the device set stays as it was until the new plugin's first message,
//!   so capacity does not dip.
//! - A stream that ends (or whose task panics) marks every device of its
//!   resource unhealthy; after `grace_period` (default 5 min) without a new
//!   registration the resource's devices are dropped and its capacity
//!   reported as zero.
//! - Every call to a plugin has a deadline; one slow plugin never delays
//!   another's registration.
//! - Allocation never holds a lock across a call to a plugin.
//! - Allocations are in the checkpoint (`kubelet_internal_checkpoint`)
//!   before [`DeviceManager::allocate_pod`] returns, and are restored on
//!   start; so are the registered resources (listed at zero after a restart
//!   until their plugins are back). One writer thread writes the newest
//!   state for every request made since its last write (group commit); on
//!   shutdown it finishes the writes asked for before exiting.
//! - Long-running parts report their health
//!   ([`DeviceManager::health_checks`]): the registration server while it
//!   cannot bind `kubelet.sock`, the checkpoint writer while writes fail.
//!
//! # Caveats
//! - Each write rewrites the whole file (upstream's format has no append):
//!   a write of 10,000 allocations is ~4 MB. The parts are encoded once and
//!   handed to `writev` as they are, and concurrent allocations share writes.
//! - The change record ([`DeviceManager::capacity_changes`]) keeps the last
//!   1,024 changes for a slow reader; one that falls further behind is told
//!   how many it missed (`RecvError::Lagged`), never silently.

mod allocate;
mod allocations;
mod checkpoint;
mod container_start;
mod device_choice;
mod devices;
mod endpoint;
mod error;
mod handler;
mod metrics;
mod registration_server;
mod resource_name;
mod run_options;
mod writer;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use allocate::{AllocateError, ContainerKind, ContainerRequest, PodContainer, PodDeviceRequest, PodDevices};
pub use checkpoint::CHECKPOINT_FILE;
pub use container_start::ContainerStartError;
pub use devices::{Capacities, CapacityChange, Device, Health, PluginOptions, ResourceCapacity};
pub use endpoint::GraceTimers;
pub use error::DeviceManagerError;
pub use handler::DevicePluginHandler;
pub use resource_name::is_extended_resource_name;
pub use run_options::{DeviceNode, MountSpec, RunOptionConflict, RunOptionKind, RunOptions};
pub use writer::CheckpointWriteError;

use crate::health::{HealthCheck, HealthReporter};

/// Capacity changes kept for a slow reader of the change record.
const CHANGE_RECORD: usize = 1024;

/// Settings of the device manager.
#[derive(Clone, Debug)]
pub struct DeviceManagerConfig {
    /// `<root-dir>/device-plugins`: holds `kubelet.sock` and plugin sockets.
    pub plugin_dir: PathBuf,
    /// Deadline to connect to a plugin.
    pub dial_timeout: Duration,
    /// Deadline for `GetDevicePluginOptions`, for opening `ListAndWatch`,
    /// and for the allocation calls.
    pub call_timeout: Duration,
    /// How long a resource whose plugin went away keeps its (unhealthy)
    /// devices before it is removed (upstream: 5 min).
    pub grace_period: Duration,
    /// Which processes may register a device plugin on `kubelet.sock`:
    /// root and the allow-list (`--plugin-allowed-uids`); the endpoint
    /// socket it names must be its user's ([`crate::plugin_trust`]).
    pub trust: crate::plugin_trust::PluginTrust,
}

impl DeviceManagerConfig {
    /// Defaults for the given device-plugins directory.
    pub fn new(plugin_dir: impl Into<PathBuf>) -> Self {
        DeviceManagerConfig {
            plugin_dir: plugin_dir.into(),
            dial_timeout: Duration::from_secs(10),
            call_timeout: Duration::from_secs(10),
            grace_period: Duration::from_secs(5 * 60),
            trust: crate::plugin_trust::PluginTrust::default(),
        }
    }
}

/// What the manager knows of one resource.
#[derive(Default)]
struct Resource {
    /// Bumped by every registration: stream tasks and grace timers of an
    /// older generation no longer touch the resource.
    generation: u64,
    /// The connected plugin, if any.
    endpoint: Option<endpoint::Endpoint>,
    /// The options of the last plugin that registered the resource, kept
    /// after it goes (a container start must know whether it wanted
    /// `PreStartContainer`); `None` for a resource only restored.
    options: Option<PluginOptions>,
    devices: BTreeMap<String, Device>,
    /// In the checkpoint's `RegisteredDevices`: from registration (or from
    /// the checkpoint at start) until removal after the grace period.
    listed: bool,
    /// Its `RegisteredDevices` checkpoint member, encoded when first needed
    /// after the device IDs change (restored resources keep their IDs from
    /// the checkpoint until their plugin sends its devices).
    registered_part: Option<Arc<checkpoint::Part>>,
    /// Cancels the running grace timer (the plugin came back).
    grace: Option<CancellationToken>,
}

struct Inner {
    config: DeviceManagerConfig,
    resources: Mutex<BTreeMap<String, Resource>>,
    /// Taken after `resources` when both are needed, never the other way.
    allocations: Mutex<allocations::Allocations>,
    capacity: watch::Sender<Capacities>,
    /// Every capacity change, in order (published with `capacity`).
    capacity_changes: broadcast::Sender<CapacityChange>,
    tasks: TaskTracker,
    shutdown: CancellationToken,
    server_generation: watch::Sender<u64>,
    registration_health: HealthReporter,
    grace_timers: watch::Sender<GraceTimers>,
    checkpoint: writer::Writer,
    metrics: metrics::Metrics,
}

/// The device manager. Cheap to clone; clones share one manager.
#[derive(Clone)]
pub struct DeviceManager {
    inner: Arc<Inner>,
}

impl DeviceManager {
    /// Prepares the device-plugins directory (0750, stale sockets removed,
    /// the checkpoint kept), serves `kubelet.sock` (recreated if removed) and
    /// returns the manager. Everything stops when `shutdown` is cancelled;
    /// await [`stopped`](Self::stopped) afterwards.
    pub fn start(
        config: DeviceManagerConfig,
        shutdown: CancellationToken,
    ) -> Result<DeviceManager, DeviceManagerError> {
        registration_server::prepare_dir(&config.plugin_dir)?;
        let restored = checkpoint::load(&config.plugin_dir.join(CHECKPOINT_FILE));
        let restored_count: usize = restored.pods.values().map(BTreeMap::len).sum();
        let restored_resources = restored.registered.len();
        // Resources from the checkpoint start with no devices and no plugin,
        // until their plugins register again (or the grace period ends).
        let resources: BTreeMap<String, Resource> = restored
            .registered
            .into_iter()
            .map(|(name, part)| (name, Resource { listed: true, registered_part: Some(part), ..Resource::default() }))
            .collect();
        let capacities: Capacities = resources.keys().map(|r| (r.clone(), ResourceCapacity::default())).collect();
        let (capacity, _) = watch::channel(capacities);
        // kubelet.sock is bound before `start` returns: generation 1.
        let (server_generation, _) = watch::channel(1);
        let manager = DeviceManager {
            inner: Arc::new(Inner {
                config,
                resources: Mutex::new(resources),
                allocations: Mutex::new(allocations::Allocations::restored(restored.pods)),
                capacity,
                capacity_changes: broadcast::Sender::new(CHANGE_RECORD),
                tasks: TaskTracker::new(),
                shutdown,
                server_generation,
                registration_health: HealthReporter::new(),
                grace_timers: watch::Sender::new(GraceTimers::default()),
                checkpoint: writer::Writer::new(),
                metrics: metrics::Metrics::default(),
            }),
        };
        if restored_count > 0 || restored_resources > 0 {
            tracing::info!(
                containers = restored_count,
                resources = restored_resources,
                "device allocations restored from the checkpoint"
            );
        }
        {
            let mut resources = manager.lock();
            for (name, entry) in resources.iter_mut() {
                manager.start_grace_timer(entry, name, 0);
            }
        }
        manager.start_checkpoint_writer()?;
        if let Err(error) = registration_server::start(manager.clone()) {
            manager.inner.checkpoint.stop();
            return Err(error);
        }
        Ok(manager)
    }

    /// Waits until every task of the manager has stopped (after shutdown).
    pub async fn stopped(&self) {
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    /// The capacity of every resource; each change publishes a new snapshot,
    /// and a slow reader simply sees the latest one (bursts coalesce).
    pub fn capacity(&self) -> watch::Receiver<Capacities> {
        self.inner.capacity.subscribe()
    }

    /// Every capacity change from now on, in the order they happened (the
    /// [`capacity`](Self::capacity) snapshots may skip some). Subscribe
    /// before acting to see what the action changes.
    pub fn capacity_changes(&self) -> broadcast::Receiver<CapacityChange> {
        self.inner.capacity_changes.subscribe()
    }

    /// The devices of `resource`, sorted by ID.
    pub fn devices(&self, resource: &str) -> Vec<Device> {
        self.lock().get(resource).map(|r| r.devices.values().cloned().collect()).unwrap_or_default()
    }

    /// Every healthy device of every resource, as `(resource, device)`,
    /// sorted: what the node can hand out (PodResources'
    /// `GetAllocatableResources`).
    pub fn allocatable_devices(&self) -> Vec<(String, Device)> {
        self.lock()
            .iter()
            .flat_map(|(name, r)| {
                r.devices.values().filter(|d| d.health == Health::Healthy).map(move |d| (name.clone(), d.clone()))
            })
            .collect()
    }

    /// What `pod_uid`'s containers hold: container name → resource →
    /// devices (with their NUMA nodes, as known now), for PodResources.
    pub fn pod_devices(&self, pod_uid: &str) -> BTreeMap<String, BTreeMap<String, Vec<Device>>> {
        let held = self.allocations().held_by_pod(pod_uid);
        let resources = self.lock();
        held.into_iter()
            .map(|(container, by_resource)| {
                let devices = by_resource
                    .into_iter()
                    .map(|(resource, ids)| {
                        let known = resources.get(&resource).map(|r| &r.devices);
                        let devices = ids
                            .into_iter()
                            .map(|id| {
                                known.and_then(|k| k.get(&id)).cloned().unwrap_or(Device {
                                    id,
                                    health: Health::Unhealthy,
                                    numa_nodes: Vec::new(),
                                })
                            })
                            .collect();
                        (resource, devices)
                    })
                    .collect();
                (container, devices)
            })
            .collect()
    }

    /// The options of the plugin serving `resource`, if one is connected.
    pub fn plugin_options(&self, resource: &str) -> Option<PluginOptions> {
        self.lock().get(resource).filter(|r| r.endpoint.is_some()).and_then(|r| r.options)
    }

    /// Counts how often `kubelet.sock` was (re)created; starts at 1.
    pub fn registration_server_generation(&self) -> watch::Receiver<u64> {
        self.inner.server_generation.subscribe()
    }

    /// The grace-period timers: how many run, how many ran out.
    pub fn grace_timers(&self) -> watch::Receiver<GraceTimers> {
        self.inner.grace_timers.subscribe()
    }

    /// The manager's health checks, for the node's `/healthz`:
    /// `device-registration-server` fails while `kubelet.sock` cannot be
    /// bound (it is retried), `device-checkpoint` while checkpoint writes
    /// fail.
    pub fn health_checks(&self) -> Vec<(&'static str, HealthCheck)> {
        vec![
            ("device-registration-server", self.inner.registration_health.check()),
            ("device-checkpoint", self.inner.checkpoint.health()),
        ]
    }

    /// A handler for plugins of type `DevicePlugin` found by the plugin watcher.
    pub fn plugin_handler(&self) -> DevicePluginHandler {
        DevicePluginHandler::new(self.clone())
    }

    /// Adds the device manager's metrics to `registry` (see the
    /// `metrics` section of the module docs).
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.inner.metrics.register(registry);
    }

    /// The path of `kubelet.sock`.
    pub fn socket_path(&self) -> PathBuf {
        self.inner.config.plugin_dir.join(kubelet_api::constants::KUBELET_SOCKET)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Resource>> {
        // Every critical section is a few map operations with no await and no
        // panic in between, so a poisoned lock still holds consistent data.
        self.inner.resources.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes `resource`'s capacity if it changed, to the snapshots and
    /// to the change record. Called with the state lock held, so changes are
    /// published in the order they happen.
    fn publish(&self, resource: &str, capacity: ResourceCapacity) {
        let changed = self.inner.capacity.send_if_modified(|all| {
            let previous = all.insert(resource.to_owned(), capacity);
            previous != Some(capacity)
        });
        if changed {
            // No receiver is not an error: nobody records now.
            let _ = self.inner.capacity_changes.send(CapacityChange { resource: resource.to_owned(), capacity });
        }
    }

    /// Asks for a checkpoint of the current state; returns its generation
    /// (`None` once the manager is shutting down).
    fn request_checkpoint(&self) -> Option<u64> {
        self.inner.checkpoint.request()
    }

    /// Writes the current state to the checkpoint and waits until it is on
    /// disk. Concurrent callers share writes (group commit).
    pub async fn persisted(&self) -> Result<(), CheckpointWriteError> {
        let generation = self.request_checkpoint().ok_or(CheckpointWriteError::ShuttingDown)?;
        self.inner.checkpoint.written(generation).await
    }

    /// Starts the writer thread; on shutdown it finishes the writes asked
    /// for, and [`stopped`](Self::stopped) waits for it.
    fn start_checkpoint_writer(&self) -> Result<(), DeviceManagerError> {
        let manager = self.clone();
        let path = self.inner.config.plugin_dir.join(CHECKPOINT_FILE);
        let span = tracing::info_span!("device_checkpoint", path = %path.display());
        let (exited_tx, exited_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("device-checkpoint".into())
            .spawn(move || {
                let _span = span.enter();
                manager.inner.checkpoint.run(|| manager.write_checkpoint(&path));
                drop(exited_tx);
            })
            .map_err(|source| DeviceManagerError::Thread { source })?;
        let manager = self.clone();
        // Not supervised: waits for shutdown to stop the checkpoint writer; nothing to restart.
        self.inner.tasks.spawn(async move {
            manager.inner.shutdown.cancelled().await;
            manager.inner.checkpoint.stop();
            let _ = exited_rx.await;
        });
        Ok(())
    }

    /// Writes the current state: the parts are collected under the locks
    /// (pointers, not bytes) and written without them.
    fn write_checkpoint(&self, path: &Path) -> Result<(), CheckpointWriteError> {
        let mut registered: Vec<Arc<checkpoint::Part>> = Vec::new();
        for (name, r) in self.lock().iter_mut().filter(|(_, r)| r.listed) {
            let part = match &r.registered_part {
                Some(part) => part.clone(),
                None => {
                    let part = Arc::new(checkpoint::Part::registered(name, r.devices.keys().map(String::as_str))?);
                    r.registered_part = Some(part.clone());
                    part
                }
            };
            registered.push(part);
        }
        let entries = self.allocations().parts();
        let started = std::time::Instant::now();
        checkpoint::write_parts(path, &entries, &registered)?;
        self.inner.metrics.checkpoint_written(started.elapsed());
        Ok(())
    }
}
