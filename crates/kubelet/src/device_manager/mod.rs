//! The device-plugin manager: device plugins register, stream their devices
//! and health, and the node's extended-resource capacity follows.
//!
//! # Flow
//! ```text
//! plugin ──Register──▶ kubelet.sock (RegistrationServer)  ─┐
//! plugins_registry/ ──▶ plugin manager ──▶ DevicePluginHandler ─┤
//!                                                              ▼
//!        DeviceManager::connect: dial <socket> → GetDevicePluginOptions
//!          → ListAndWatch (stream task per endpoint, replaces any older one)
//!                                                              ▼
//!        device sets per resource ──▶ capacity watch (coalesced snapshots)
//! ```
//!
//! # Guarantees
//! - `Register` answers only once the plugin is connected and its stream open.
//! - A second registration of a resource replaces the first cleanly: the old
//!   stream task is cancelled, its late messages are ignored (generations),
//!   and the device set stays as it was until the new plugin's first message,
//!   so capacity does not dip.
//! - A stream that ends marks every device of its resource unhealthy; after
//!   `grace_period` (default 5 min) without a new registration the resource's
//!   devices are dropped and its capacity reported as zero.
//! - Every call to a plugin has a deadline; one slow plugin never delays
//!   another's registration.
//!
//! - Allocation (see [`DeviceManager::allocate`]) never holds a lock across
//!   a call to a plugin.
//!
//! - Allocations are in the checkpoint (`kubelet_internal_checkpoint`)
//!   before [`DeviceManager::allocate`] returns, and are restored on start;
//!   so are the registered resources (listed at zero after a restart until
//!   their plugins are back). One writer thread writes the newest state for
//!   every request made since its last write (group commit); on shutdown it
//!   finishes the writes asked for before exiting.
//!
//! # Caveats
//! - Each write rewrites the whole file (upstream's format has no append):
//!   a write of 10,000 allocations is ~4 MB. The parts are encoded once and
//!   handed to `writev` as they are, and concurrent allocations share writes.

mod allocate;
mod allocation;
mod checkpoint;
mod devices;
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

use kubelet_api::deviceplugin::v1beta1::Empty;
use kubelet_api::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use kubelet_api::uds::{self, UdsChannel};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

pub use allocate::{AllocateError, ContainerKind, ContainerRequest};
pub use checkpoint::{CHECKPOINT_FILE, CheckpointError};
pub use devices::{Capacities, Device, Health, PluginOptions, ResourceCapacity};
pub use error::{DeviceManagerError, RegisterError};
pub use handler::DevicePluginHandler;
pub use resource_name::is_extended_resource_name;
pub use run_options::{DeviceNode, MountSpec, RunOptions};

/// Allocation calls in flight to one plugin at most; more wait their turn.
/// Thousands of streams at once on one connection make plugins reset it, and
/// common servers allow 100–200 concurrent streams per connection.
const MAX_CALLS_PER_PLUGIN: usize = 128;

/// Settings of the device manager.
#[derive(Clone, Debug)]
pub struct DeviceManagerConfig {
    /// `<root-dir>/device-plugins`: holds `kubelet.sock` and plugin sockets.
    pub plugin_dir: PathBuf,
    /// Deadline to connect to a plugin.
    pub dial_timeout: Duration,
    /// Deadline for `GetDevicePluginOptions` and for opening `ListAndWatch`.
    pub call_timeout: Duration,
    /// How long a resource whose plugin went away keeps its (unhealthy)
    /// devices before it is removed (upstream: 5 min).
    pub grace_period: Duration,
}

impl DeviceManagerConfig {
    /// Defaults for the given device-plugins directory.
    pub fn new(plugin_dir: impl Into<PathBuf>) -> Self {
        DeviceManagerConfig {
            plugin_dir: plugin_dir.into(),
            dial_timeout: Duration::from_secs(10),
            call_timeout: Duration::from_secs(10),
            grace_period: Duration::from_secs(5 * 60),
        }
    }
}

/// A connected plugin.
struct Endpoint {
    socket: PathBuf,
    options: PluginOptions,
    /// For the allocation calls.
    channel: UdsChannel,
    /// Bounds the calls in flight to this plugin (all share one connection).
    calls: Arc<tokio::sync::Semaphore>,
    cancel: CancellationToken,
}

#[derive(Default)]
struct Resource {
    /// Bumped by every registration: stream tasks and grace timers of an
    /// older generation no longer touch the resource.
    generation: u64,
    endpoint: Option<Endpoint>,
    devices: BTreeMap<String, Device>,
    /// In the checkpoint's `RegisteredDevices`: from registration (or from
    /// the checkpoint at start) until removal after the grace period.
    listed: bool,
    /// Its `RegisteredDevices` checkpoint member, encoded when first needed
    /// after the device IDs change (restored resources keep their IDs from
    /// the checkpoint until their plugin sends its devices).
    registered_part: Option<Arc<checkpoint::Part>>,
}

struct Inner {
    config: DeviceManagerConfig,
    resources: Mutex<BTreeMap<String, Resource>>,
    /// Taken after `resources` when both are needed, never the other way.
    allocations: Mutex<allocate::Allocations>,
    capacity: watch::Sender<Capacities>,
    tasks: TaskTracker,
    shutdown: CancellationToken,
    server_generation: watch::Sender<u64>,
    grace_timers_fired: watch::Sender<u64>,
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
        // Resources from the checkpoint start with no devices and no plugin,
        // until their plugins register again (or the grace period ends).
        let resources: BTreeMap<String, Resource> = restored
            .registered
            .iter()
            .map(|(name, ids)| {
                let part = checkpoint::Part::registered(name, ids.iter().map(String::as_str));
                (name.clone(), Resource { listed: true, registered_part: Some(Arc::new(part)), ..Resource::default() })
            })
            .collect();
        let capacities: Capacities = resources.keys().map(|r| (r.clone(), ResourceCapacity::default())).collect();
        let (capacity, _) = watch::channel(capacities);
        // kubelet.sock is bound before `start` returns: generation 1.
        let (server_generation, _) = watch::channel(1);
        let (grace_timers_fired, _) = watch::channel(0);
        let manager = DeviceManager {
            inner: Arc::new(Inner {
                config,
                resources: Mutex::new(resources),
                allocations: Mutex::new(allocate::Allocations::restored(restored.pods)),
                capacity,
                tasks: TaskTracker::new(),
                shutdown,
                server_generation,
                grace_timers_fired,
                checkpoint: writer::Writer::new(),
                metrics: metrics::Metrics::default(),
            }),
        };
        if restored_count > 0 || !restored.registered.is_empty() {
            tracing::info!(
                containers = restored_count,
                resources = restored.registered.len(),
                "device allocations restored from the checkpoint"
            );
        }
        for resource in restored.registered.keys() {
            manager.start_grace_timer(resource, 0);
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

    /// The devices of `resource`, sorted by ID.
    pub fn devices(&self, resource: &str) -> Vec<Device> {
        self.lock().get(resource).map(|r| r.devices.values().cloned().collect()).unwrap_or_default()
    }

    /// The options of the plugin serving `resource`, if one is connected.
    pub fn plugin_options(&self, resource: &str) -> Option<PluginOptions> {
        self.lock().get(resource).and_then(|r| r.endpoint.as_ref()).map(|e| e.options)
    }

    /// Counts how often `kubelet.sock` was (re)created; starts at 1.
    pub fn registration_server_generation(&self) -> watch::Receiver<u64> {
        self.inner.server_generation.subscribe()
    }

    /// Counts grace-period timers that ran out (whether or not they removed
    /// a resource: a plugin that came back in time keeps it).
    pub fn grace_timers_fired(&self) -> watch::Receiver<u64> {
        self.inner.grace_timers_fired.subscribe()
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

    /// Connects to the plugin for `resource` at `socket` and starts watching
    /// its devices. Returns once the `ListAndWatch` stream is open.
    pub(crate) async fn connect(&self, resource: &str, socket: &Path) -> Result<(), RegisterError> {
        if self.inner.shutdown.is_cancelled() {
            return Err(RegisterError::ShuttingDown);
        }
        let config = &self.inner.config;
        let channel = uds::dial(socket, config.dial_timeout)
            .await
            .map_err(|source| RegisterError::Dial { resource: resource.to_owned(), source })?;
        let mut client = DevicePluginClient::new(channel.clone());
        let options: PluginOptions =
            call(resource, "GetDevicePluginOptions", config.call_timeout, client.get_device_plugin_options(Empty {}))
                .await?
                .into();
        let stream = call(resource, "ListAndWatch", config.call_timeout, client.list_and_watch(Empty {})).await?;

        let cancel = self.inner.shutdown.child_token();
        let generation = {
            let mut resources = self.lock();
            let entry = resources.entry(resource.to_owned()).or_default();
            if let Some(old) = entry.endpoint.take() {
                old.cancel.cancel();
                tracing::info!(resource, old = %old.socket.display(), new = %socket.display(), "device plugin replaced");
            }
            entry.generation += 1;
            entry.listed = true;
            entry.endpoint = Some(Endpoint {
                socket: socket.to_path_buf(),
                options,
                channel,
                calls: Arc::new(tokio::sync::Semaphore::new(MAX_CALLS_PER_PLUGIN)),
                cancel: cancel.clone(),
            });
            entry.generation
        };
        tracing::info!(resource, socket = %socket.display(), ?options, "device plugin registered");
        // The registered resources are in the checkpoint: after a restart
        // they are listed (at zero) until their plugins come back.
        self.request_checkpoint();
        let span = tracing::info_span!("list_and_watch", resource, socket = %socket.display());
        let manager = self.clone();
        let resource = resource.to_owned();
        self.inner.tasks.spawn(
            async move {
                manager.watch_devices(&resource, generation, stream, cancel).await;
            }
            .instrument(span),
        );
        Ok(())
    }

    /// Forgets the plugin for `resource` if it is the one at `socket`, as if
    /// its stream had ended.
    pub(crate) fn disconnect(&self, resource: &str, socket: &Path) {
        let generation = {
            let resources = self.lock();
            match resources.get(resource) {
                Some(r) if r.endpoint.as_ref().is_some_and(|e| e.socket == socket) => r.generation,
                _ => return,
            }
        };
        self.stream_ended(resource, generation, "plugin deregistered");
    }

    async fn watch_devices(
        &self,
        resource: &str,
        generation: u64,
        mut stream: tonic::Streaming<kubelet_api::deviceplugin::v1beta1::ListAndWatchResponse>,
        cancel: CancellationToken,
    ) {
        let reason = loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                message = stream.message() => match message {
                    Ok(Some(response)) => self.replace_devices(resource, generation, response),
                    Ok(None) => break "stream ended".to_owned(),
                    Err(status) => break format!("stream failed: {status}"),
                },
            }
        };
        self.stream_ended(resource, generation, &reason);
    }

    fn replace_devices(
        &self,
        resource: &str,
        generation: u64,
        response: kubelet_api::deviceplugin::v1beta1::ListAndWatchResponse,
    ) {
        let (devices, rejected) = devices::device_set(response);
        if rejected.empty_ids > 0 || !rejected.duplicate_ids.is_empty() {
            tracing::warn!(
                resource,
                empty_ids = rejected.empty_ids,
                duplicate_ids = ?rejected.duplicate_ids,
                "device plugin sent devices with empty or duplicate IDs; they were dropped"
            );
        }
        let mut resources = self.lock();
        let Some(entry) = resources.get_mut(resource).filter(|r| r.generation == generation) else { return };
        let capacity = devices::capacity_of(devices.values());
        let ids_changed = !entry.devices.keys().eq(devices.keys());
        entry.devices = devices;
        tracing::debug!(resource, capacity = capacity.capacity, allocatable = capacity.allocatable, "devices updated");
        self.publish(resource, capacity);
        if ids_changed {
            entry.registered_part = None;
            drop(resources);
            self.request_checkpoint();
        }
    }

    fn stream_ended(&self, resource: &str, generation: u64, reason: &str) {
        {
            let mut resources = self.lock();
            let Some(entry) = resources.get_mut(resource).filter(|r| r.generation == generation) else { return };
            let Some(endpoint) = entry.endpoint.take() else { return };
            endpoint.cancel.cancel();
            for device in entry.devices.values_mut() {
                device.health = Health::Unhealthy;
            }
            let capacity = devices::capacity_of(entry.devices.values());
            self.publish(resource, capacity);
        }
        tracing::warn!(
            resource,
            reason,
            grace = ?self.inner.config.grace_period,
            "device plugin gone; its devices are unhealthy until it registers again"
        );
        self.start_grace_timer(resource, generation);
    }

    /// Removes `resource`'s devices after the grace period unless a plugin
    /// registered it again meanwhile.
    fn start_grace_timer(&self, resource: &str, generation: u64) {
        let grace = self.inner.config.grace_period;
        let manager = self.clone();
        let resource = resource.to_owned();
        let shutdown = self.inner.shutdown.clone();
        self.inner.tasks.spawn(async move {
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(grace) => manager.remove_after_grace(&resource, generation),
            }
        });
    }

    /// Asks for a checkpoint of the current state; returns its generation
    /// (`None` once the manager is shutting down).
    pub(crate) fn request_checkpoint(&self) -> Option<u64> {
        self.inner.checkpoint.request()
    }

    /// Writes the current state to the checkpoint and waits until it is on
    /// disk. Concurrent callers share writes (group commit).
    pub async fn persisted(&self) -> Result<(), String> {
        let Some(generation) = self.request_checkpoint() else {
            return Err("the device manager is shutting down".into());
        };
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
        self.inner.tasks.spawn(async move {
            manager.inner.shutdown.cancelled().await;
            manager.inner.checkpoint.stop();
            let _ = exited_rx.await;
        });
        Ok(())
    }

    /// Writes the current state: the parts are collected under the locks
    /// (pointers, not bytes) and written without them.
    fn write_checkpoint(&self, path: &Path) -> Result<(), String> {
        let registered: Vec<Arc<checkpoint::Part>> = self
            .lock()
            .iter_mut()
            .filter(|(_, r)| r.listed)
            .map(|(name, r)| {
                r.registered_part
                    .get_or_insert_with(|| {
                        Arc::new(checkpoint::Part::registered(name, r.devices.keys().map(String::as_str)))
                    })
                    .clone()
            })
            .collect();
        let entries = self.allocations().parts();
        let started = std::time::Instant::now();
        checkpoint::write_parts(path, &entries, &registered).map_err(|e| e.to_string())?;
        self.inner.metrics.checkpoint_written(started.elapsed());
        Ok(())
    }

    fn remove_after_grace(&self, resource: &str, generation: u64) {
        let _fired = FireOnDrop(&self.inner.grace_timers_fired);
        let mut resources = self.lock();
        let Some(entry) = resources.get_mut(resource) else { return };
        if entry.generation != generation || entry.endpoint.is_some() {
            return;
        }
        entry.devices.clear();
        entry.listed = false;
        entry.registered_part = None;
        tracing::info!(resource, "device plugin did not come back within the grace period; resource removed");
        self.publish(resource, ResourceCapacity::default());
        drop(resources);
        self.request_checkpoint();
    }

    /// Publishes `resource`'s capacity if it changed. Called with the state
    /// lock held, so snapshots are published in the order of the changes.
    fn publish(&self, resource: &str, capacity: ResourceCapacity) {
        self.inner.capacity.send_if_modified(|all| {
            let previous = all.insert(resource.to_owned(), capacity);
            previous != Some(capacity)
        });
    }
}

/// Counts a fired grace timer once its work is done.
struct FireOnDrop<'a>(&'a watch::Sender<u64>);

impl Drop for FireOnDrop<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n += 1);
    }
}

/// Awaits a unary or streaming-open call with a deadline.
async fn call<T>(
    resource: &str,
    rpc: &'static str,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, RegisterError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(RegisterError::Rpc { resource: resource.to_owned(), rpc, status }),
        Err(_) => Err(RegisterError::Timeout { resource: resource.to_owned(), rpc, timeout }),
    }
}
