//! A device plugin's connection and its lifecycle: connect, watch its
//! devices, replace it on a second registration, and after its stream ends
//! keep its devices (unhealthy) for the grace period, then remove them.
//!
//! # Flow
//! ```text
//! connect: dial → GetDevicePluginOptions → open ListAndWatch → generation + 1
//!   → stream task: each message replaces the device set ─┐
//!                                                        ├─▶ capacity (watch + change record)
//!   stream ends / fails / its task panics / deregistered ─┘
//!     → devices unhealthy → grace timer → devices removed, capacity 0
//!   a registration during the grace period cancels the timer
//! ```
//!
//! # Guarantees
//! - Every registration bumps the resource's generation: stream tasks and
//!   grace timers of an older generation no longer touch the resource.
//! - A panic in the stream task is caught and logged (error level, with the
//!   resource) and counts as the end of the stream: the manager is never
//!   left with a resource that looks connected but is not watched.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kubelet_api::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use kubelet_api::deviceplugin::v1beta1::{Empty, ListAndWatchResponse};
use kubelet_api::uds::{self, UdsChannel};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::devices::{self, Health, PluginOptions, ResourceCapacity};
use super::error::RegisterError;
use super::{DeviceManager, Resource};

/// Allocation calls in flight to one plugin at most; more wait their turn.
/// Thousands of streams at once on one connection make plugins reset it, and
/// common servers allow 100–200 concurrent streams per connection.
const MAX_CALLS_PER_PLUGIN: usize = 128;

/// A connected plugin.
pub(super) struct Endpoint {
    pub(super) socket: PathBuf,
    /// For the allocation and start calls.
    pub(super) channel: UdsChannel,
    /// Bounds the calls in flight to this plugin (all share one connection).
    pub(super) calls: Arc<tokio::sync::Semaphore>,
    /// Stops its stream task.
    pub(super) cancel: CancellationToken,
}

/// The grace-period timers of resources whose plugin went away.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraceTimers {
    /// Timers counting down now.
    pub running: usize,
    /// Timers that ran out (whether or not they removed a resource).
    pub fired: u64,
}

/// How a call to a plugin failed; each caller turns it into its own error.
pub(super) enum CallFailure {
    /// The plugin answered with an error status.
    Status(tonic::Status),
    /// No answer within the deadline.
    Timeout(Duration),
}

/// Awaits a unary or streaming-open call with a deadline.
pub(super) async fn call<T>(
    timeout: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, CallFailure> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(CallFailure::Status(status)),
        Err(_) => Err(CallFailure::Timeout(timeout)),
    }
}

fn register_error(resource: &str, rpc: &'static str, failure: CallFailure) -> RegisterError {
    let resource = resource.to_owned();
    match failure {
        CallFailure::Status(status) => RegisterError::Rpc { resource, rpc, status },
        CallFailure::Timeout(timeout) => RegisterError::Timeout { resource, rpc, timeout },
    }
}

impl DeviceManager {
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
        let options: PluginOptions = call(config.call_timeout, client.get_device_plugin_options(Empty {}))
            .await
            .map_err(|f| register_error(resource, "GetDevicePluginOptions", f))?
            .into();
        let stream = call(config.call_timeout, client.list_and_watch(Empty {}))
            .await
            .map_err(|f| register_error(resource, "ListAndWatch", f))?;

        let cancel = self.inner.shutdown.child_token();
        let generation = {
            let mut resources = self.lock();
            let entry = resources.entry(resource.to_owned()).or_default();
            if let Some(old) = entry.endpoint.take() {
                old.cancel.cancel();
                tracing::info!(resource, old = %old.socket.display(), new = %socket.display(), "device plugin replaced");
            }
            if let Some(timer) = entry.grace.take() {
                // Back within the grace period: the resource stays.
                timer.cancel();
            }
            entry.generation += 1;
            entry.listed = true;
            entry.options = Some(options);
            entry.endpoint = Some(Endpoint {
                socket: socket.to_path_buf(),
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
        let watching = self.clone().watch_devices(resource.to_owned(), generation, stream, cancel);
        self.supervise_stream(resource, generation, watching, span);
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

    /// Runs `watching` (a stream loop: `Some(reason)` when the stream ended,
    /// `None` when it was cancelled) in its own task, and a second task that
    /// waits for it: a panic in the loop is logged and ends the stream like
    /// any other failure.
    pub(super) fn supervise_stream(
        &self,
        resource: &str,
        generation: u64,
        watching: impl std::future::Future<Output = Option<String>> + Send + 'static,
        span: tracing::Span,
    ) {
        // Not supervised: one plugin's ListAndWatch stream, for as long as it is connected; the task below reports its end.
        let watching = self.inner.tasks.spawn(watching.instrument(span.clone()));
        let manager = self.clone();
        let resource = resource.to_owned();
        // Not supervised: reports the end of the stream above (a panic too) and ends.
        self.inner.tasks.spawn(
            async move {
                let reason = match watching.await {
                    Ok(Some(reason)) => reason,
                    Ok(None) => return,
                    // Cancelled: the runtime is shutting down (we never abort it).
                    Err(error) if error.is_cancelled() => return,
                    Err(error) => {
                        let panic =
                            error.try_into_panic().map(|p| crate::health::panic_message(&*p)).unwrap_or_default();
                        tracing::error!(
                            resource,
                            panic,
                            "device plugin stream task panicked; handling it as the end of the stream"
                        );
                        format!("stream task panicked: {panic}")
                    }
                };
                manager.stream_ended(&resource, generation, &reason);
            }
            .instrument(span),
        );
    }

    /// Applies each `ListAndWatch` message until the stream ends (returns
    /// why) or `cancel` fires (returns `None`).
    async fn watch_devices(
        self,
        resource: String,
        generation: u64,
        mut stream: tonic::Streaming<ListAndWatchResponse>,
        cancel: CancellationToken,
    ) -> Option<String> {
        loop {
            tokio::select! {
                () = cancel.cancelled() => return None,
                message = stream.message() => match message {
                    Ok(Some(response)) => self.replace_devices(&resource, generation, response),
                    Ok(None) => return Some("stream ended".to_owned()),
                    Err(status) => return Some(format!("stream failed: {status}")),
                },
            }
        }
    }

    fn replace_devices(&self, resource: &str, generation: u64, response: ListAndWatchResponse) {
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

    /// The plugin of `generation` is gone: its devices turn unhealthy and
    /// the grace timer starts.
    pub(super) fn stream_ended(&self, resource: &str, generation: u64, reason: &str) {
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
            self.start_grace_timer(entry, resource, generation);
        }
        tracing::warn!(
            resource,
            reason,
            grace = ?self.inner.config.grace_period,
            "device plugin gone; its devices are unhealthy until it registers again"
        );
    }

    /// Removes `resource`'s devices after the grace period unless a plugin
    /// registers it again meanwhile (which cancels the timer). Called with
    /// the state lock held (`entry` is the resource's state).
    pub(super) fn start_grace_timer(&self, entry: &mut Resource, resource: &str, generation: u64) {
        let cancel = self.inner.shutdown.child_token();
        if let Some(older) = entry.grace.replace(cancel.clone()) {
            older.cancel();
        }
        self.inner.grace_timers.send_modify(|t| t.running += 1);
        let grace = self.inner.config.grace_period;
        let manager = self.clone();
        let span = tracing::info_span!("grace_timer", resource, generation);
        let resource = resource.to_owned();
        // Not supervised: one grace timer of a plugin that left.
        self.inner.tasks.spawn(
            async move {
                let fired = tokio::select! {
                    () = cancel.cancelled() => false,
                    () = tokio::time::sleep(grace) => true,
                };
                if fired {
                    manager.remove_after_grace(&resource, generation);
                }
                manager.inner.grace_timers.send_modify(|t| {
                    t.running -= 1;
                    t.fired += u64::from(fired);
                });
            }
            .instrument(span),
        );
    }

    fn remove_after_grace(&self, resource: &str, generation: u64) {
        let mut resources = self.lock();
        let Some(entry) = resources.get_mut(resource) else { return };
        // A stale timer (a later registration came and went) changes nothing.
        if entry.generation != generation || entry.endpoint.is_some() {
            return;
        }
        entry.grace = None;
        entry.devices.clear();
        entry.listed = false;
        entry.registered_part = None;
        tracing::info!(resource, "device plugin did not come back within the grace period; resource removed");
        self.publish(resource, ResourceCapacity::default());
        drop(resources);
        self.request_checkpoint();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::device_manager::{CapacityChange, Device, DeviceManagerConfig};

    const R: &str = "vendor.example.com/gpu";
    const SOON: Duration = Duration::from_secs(20);

    /// A manager (grace period one hour) whose resource `R` has two healthy
    /// devices and a plugin "connected" at generation 1: a listener that
    /// accepts and never answers stands in for the plugin, as nothing here
    /// calls it.
    async fn manager_with_a_plugin(dir: &Path) -> (DeviceManager, CancellationToken, tokio::task::JoinHandle<()>) {
        let mut config = DeviceManagerConfig::new(dir.join("device-plugins"));
        config.grace_period = Duration::from_secs(3600);
        let shutdown = CancellationToken::new();
        let manager = DeviceManager::start(config, shutdown.clone()).expect("start");
        let socket = dir.join("plugin.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        let accepting = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let channel = uds::dial(&socket, SOON).await.expect("dial");
        let devices: BTreeMap<String, Device> = ["a", "b"]
            .into_iter()
            .map(|id| (id.to_owned(), Device { id: id.to_owned(), health: Health::Healthy, numa_nodes: vec![] }))
            .collect();
        let mut resources = manager.lock();
        let entry = resources.entry(R.to_owned()).or_default();
        entry.generation = 1;
        entry.listed = true;
        entry.devices = devices;
        entry.endpoint = Some(Endpoint {
            socket,
            channel,
            calls: Arc::new(tokio::sync::Semaphore::new(1)),
            cancel: CancellationToken::new(),
        });
        manager.publish(R, ResourceCapacity { capacity: 2, allocatable: 2 });
        drop(resources);
        (manager, shutdown, accepting)
    }

    async fn next_change(changes: &mut tokio::sync::broadcast::Receiver<CapacityChange>) -> CapacityChange {
        tokio::time::timeout(SOON, changes.recv()).await.expect("a change in time").expect("no change lost")
    }

    /// A stream task that panics (here while holding the state lock, so the
    /// lock is poisoned too) ends the stream like any failure: the devices
    /// turn unhealthy, the grace timer starts, and the manager keeps working.
    #[tokio::test]
    async fn a_panicking_stream_task_ends_the_stream_and_leaves_the_manager_working() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (manager, shutdown, _plugin) = manager_with_a_plugin(dir.path()).await;
        let mut changes = manager.capacity_changes();
        let mut timers = manager.grace_timers();
        let panicking = {
            let manager = manager.clone();
            async move {
                let _state = manager.lock();
                panic!("bug in the stream handling");
            }
        };
        manager.supervise_stream(R, 1, panicking, tracing::Span::none());
        assert_eq!(
            next_change(&mut changes).await,
            CapacityChange { resource: R.into(), capacity: ResourceCapacity { capacity: 2, allocatable: 0 } }
        );
        tokio::time::timeout(SOON, timers.wait_for(|t| t.running == 1)).await.expect("in time").expect("alive");
        assert!(manager.devices(R).iter().all(|d| d.health == Health::Unhealthy));
        assert!(manager.persisted().await.is_ok(), "the checkpoint is still written");
        shutdown.cancel();
        manager.stopped().await;
    }

    /// A grace timer of an older generation (its plugin came back and went
    /// again) leaves the resource alone; the current one removes it.
    #[tokio::test]
    async fn a_stale_grace_timer_changes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (manager, shutdown, _plugin) = manager_with_a_plugin(dir.path()).await;
        manager.stream_ended(R, 1, "test");
        let mut changes = manager.capacity_changes();
        manager.lock().get_mut(R).expect("resource").generation = 2;
        manager.remove_after_grace(R, 1);
        assert_eq!(manager.devices(R).len(), 2, "kept");
        manager.remove_after_grace(R, 2);
        assert!(manager.devices(R).is_empty(), "removed");
        assert_eq!(
            next_change(&mut changes).await,
            CapacityChange { resource: R.into(), capacity: ResourceCapacity::default() },
            "the first change is the removal"
        );
        shutdown.cancel();
        manager.stopped().await;
    }
}
