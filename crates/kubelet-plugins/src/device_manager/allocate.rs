//! Allocating devices to pods and containers, and freeing them.
//!
//! # Flow, per device-plugin resource in a container's limits
//! 1. Same count already allocated to this container: reuse it (idempotent);
//!    a different count is an error.
//! 2. Under the locks: find the free healthy devices and the ones this pod's
//!    earlier init containers hold (reusable); too few is an error. Unless
//!    the plugin offers `GetPreferredAllocation`, choose (see
//!    `device_choice`) and reserve the devices right away.
//! 3. Without the locks: `GetPreferredAllocation` when the plugin offers it;
//!    then, under the locks, choose against the state as it is now and
//!    reserve.
//! 4. Without the locks: `Allocate` (one container, deadline); the
//!    checkpoint entry is encoded.
//! 5. Under the lock: record the allocation in the index (`allocations`),
//!    or release the reservation.
//! 6. Wait for the checkpoint write that covers it (shared with concurrent
//!    allocations).
//!
//! `PreStartContainer` is not part of the allocation: it is called each time
//! a container starts (see `container_start`), as upstream does.
//!
//! # Pods
//! [`DeviceManager::allocate_pod`] allocates a pod's init containers first,
//! in the order given, then its restartable init containers (sidecars) and
//! its app containers, each in the order given, whatever order the caller
//! lists them in: which init devices later containers reuse never depends
//! on the caller. The whole pod waits for one checkpoint write, and a
//! failure undoes everything the call recorded for the pod.
//!
//! # Cost
//! Finding the free devices is one walk over the resource's devices,
//! whatever the number of allocations on the node (see `allocations`); a
//! checkpoint entry is encoded once, when its allocation is made.
//!
//! No lock is held across a call to a plugin: concurrent allocations wait
//! for each other only while one chooses (a walk over its resource's
//! devices), and for a free slot when 128 calls to the same plugin are in
//! flight. A failure leaves nothing recorded: what the call allocated
//! before it failed is released too. So does a call whose caller drops it
//! midway (its reservations are released, and what it recorded is removed
//! and the removal checkpointed).
//!
//! # Guarantees
//! - App containers of a pod never share devices; a pod's (non-restartable)
//!   init containers' devices are reused by its later containers; sidecars
//!   (restartable init containers) keep theirs.
//!
//! # Caveats
//! - `free_pod` and `retain_pods` rewrite the checkpoint in the background:
//!   after a crash in between, the freed pods' devices come back allocated
//!   until they are freed again.
//! - A `GetPreferredAllocation` that fails or times out is logged and the
//!   node chooses by itself.
//! - Two concurrent calls for the same container: the second may return the
//!   first's run options before they are on disk, and keep them if the
//!   first's checkpoint write then fails. The pod lifecycle makes one call
//!   per pod at a time.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kubelet_api::deviceplugin::v1beta1 as api;
use kubelet_api::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;

use super::DeviceManager;
use super::allocations::{Allocations, Held, free_devices};
use super::checkpoint::Part;
use super::device_choice::choose;
use super::devices::{Device, Health};
use super::endpoint::{CallFailure, call};
use super::run_options::RunOptions;
use super::writer::CheckpointWriteError;

pub use kubelet_provider::ContainerKind;

/// One container's device request.
#[derive(Clone, Debug)]
pub struct ContainerRequest {
    /// The pod's UID.
    pub pod_uid: String,
    /// The pod's name (for messages).
    pub pod_name: String,
    /// The container's name.
    pub container_name: String,
    /// Its kind.
    pub kind: ContainerKind,
    /// `resources.limits`; resources no device plugin ever registered are ignored.
    pub limits: BTreeMap<String, u64>,
}

/// A pod's device request: every container of the pod, in any order.
#[derive(Clone, Debug)]
pub struct PodDeviceRequest {
    /// The pod's UID.
    pub pod_uid: String,
    /// The pod's name (for messages).
    pub pod_name: String,
    /// Its containers (init, sidecar and app), in any order.
    pub containers: Vec<PodContainer>,
}

/// One container of a [`PodDeviceRequest`].
#[derive(Clone, Debug)]
pub struct PodContainer {
    /// The container's name.
    pub name: String,
    /// Its kind.
    pub kind: ContainerKind,
    /// `resources.limits`; resources no device plugin ever registered are ignored.
    pub limits: BTreeMap<String, u64>,
}

/// The run options of a pod's containers, by container name (containers
/// without devices get empty options).
pub type PodDevices = BTreeMap<String, RunOptions>;

/// Why a container's devices could not be allocated. The first four texts
/// are upstream's.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// The container asked for a different count than it was given before.
    #[error("pod {pod:?} container {container:?} changed request for resource {resource:?} from {from} to {to}")]
    ChangedRequest {
        /// Pod name.
        pod: String,
        /// Container name.
        container: String,
        /// Resource.
        resource: String,
        /// The count allocated before.
        from: u64,
        /// The count asked for now.
        to: u64,
    },
    /// The resource's plugin is gone and its devices removed.
    #[error("cannot allocate unregistered device {0}")]
    Unregistered(String),
    /// No device of the resource is healthy.
    #[error("no healthy devices present; cannot allocate unhealthy devices {0}")]
    NoHealthy(String),
    /// Not enough free healthy devices.
    #[error("requested number of devices unavailable for {resource}. Requested: {requested}, Available: {available}")]
    Unavailable {
        /// Resource.
        resource: String,
        /// Devices asked for.
        requested: u64,
        /// Free healthy devices.
        available: usize,
    },
    /// A call to the plugin failed.
    #[error("{rpc} failed for resource {resource}: {status}")]
    Rpc {
        /// Resource.
        resource: String,
        /// The RPC.
        rpc: &'static str,
        /// The gRPC status.
        #[source]
        status: tonic::Status,
    },
    /// A call to the plugin did not answer in time.
    #[error("{rpc} for resource {resource} did not answer within {timeout:?}")]
    Timeout {
        /// Resource.
        resource: String,
        /// The RPC.
        rpc: &'static str,
        /// The deadline.
        timeout: Duration,
    },
    /// The plugin's answer is unusable.
    #[error("Allocate for resource {resource} returned an unusable answer: {reason}")]
    BadResponse {
        /// Resource.
        resource: String,
        /// What is wrong.
        reason: String,
    },
    /// The allocation could not be made durable (or its checkpoint entry
    /// not encoded); nothing of it is kept.
    #[error("the allocation was not recorded: {0}")]
    Checkpoint(#[source] CheckpointWriteError),
}

impl AllocateError {
    fn of_call(resource: &str, rpc: &'static str, failure: CallFailure) -> AllocateError {
        let resource = resource.to_owned();
        match failure {
            CallFailure::Status(status) => AllocateError::Rpc { resource, rpc, status },
            CallFailure::Timeout(timeout) => AllocateError::Timeout { resource, rpc, timeout },
        }
    }
}

/// Devices chosen and reserved, with their NUMA node.
type Chosen = Vec<(String, i64)>;

/// How a resource's devices are chosen.
enum Choice {
    /// Chosen and reserved already.
    Made(Chosen),
    /// The plugin is asked first; then chosen again under the lock.
    AskPlugin { available: Vec<String>, must: Vec<String> },
}

/// What the lock-free part of an allocation needs.
struct Plan {
    choice: Choice,
    client: DevicePluginClient<kubelet_api::uds::UdsChannel>,
    calls: Arc<tokio::sync::Semaphore>,
}

enum Step {
    /// Already allocated with the same count.
    Existing(RunOptions),
    /// Newly allocated.
    New(Held),
}

impl DeviceManager {
    /// Allocates the devices of every device-plugin resource in the
    /// container's limits and returns the merged run options. The
    /// allocation is in the checkpoint when this returns.
    pub async fn allocate(&self, request: &ContainerRequest) -> Result<RunOptions, AllocateError> {
        let mut undo = Undo { manager: self, added: Vec::new() };
        let options = self.allocate_container(request, &mut undo).await?;
        self.commit(undo).await?;
        Ok(options)
    }

    /// Allocates the devices of every container of the pod (init containers
    /// first, in their order; then sidecars and app containers, each in
    /// their order) and returns each container's run options. All of it is
    /// in the checkpoint when this returns; on an error nothing this call
    /// allocated is kept.
    pub async fn allocate_pod(&self, pod: &PodDeviceRequest) -> Result<PodDevices, AllocateError> {
        let mut undo = Undo { manager: self, added: Vec::new() };
        let mut devices = PodDevices::new();
        for container in allocation_order(&pod.containers) {
            let request = ContainerRequest {
                pod_uid: pod.pod_uid.clone(),
                pod_name: pod.pod_name.clone(),
                container_name: container.name.clone(),
                kind: container.kind,
                limits: container.limits.clone(),
            };
            // On an error, dropping `undo` removes what this call recorded.
            let options = self.allocate_container(&request, &mut undo).await?;
            devices.insert(container.name.clone(), options);
        }
        self.commit(undo).await?;
        Ok(devices)
    }

    /// Allocates one container's devices and records them; `undo` collects
    /// what was recorded.
    async fn allocate_container(
        &self,
        request: &ContainerRequest,
        undo: &mut Undo<'_>,
    ) -> Result<RunOptions, AllocateError> {
        let span = tracing::info_span!(
            "allocate",
            pod.uid = %request.pod_uid,
            pod = %request.pod_name,
            container = %request.container_name
        );
        // Per resource, in resource-name order (the limits are sorted).
        let mut parts: Vec<(&str, RunOptions)> = Vec::new();
        for (resource, &count) in &request.limits {
            if count == 0 {
                continue;
            }
            match self.allocate_resource(request, resource, count).await {
                Ok(None) => {}
                Ok(Some(Step::Existing(options))) => parts.push((resource, options)),
                Ok(Some(Step::New(held))) => {
                    tracing::info!(parent: &span, resource, devices = ?held.device_ids, "devices allocated");
                    parts.push((resource, held.options.clone()));
                    let (pod, container) = (&request.pod_uid, &request.container_name);
                    self.allocations().insert(pod, container, request.kind, resource, held);
                    undo.added.push((pod.clone(), container.clone(), resource.clone()));
                }
                Err(error) => {
                    tracing::warn!(parent: &span, resource, %error, "device allocation failed");
                    return Err(error);
                }
            }
        }
        let merged = RunOptions::merged(parts.iter().map(|(resource, options)| (*resource, options)));
        for conflict in &merged.conflicts {
            tracing::warn!(parent: &span, %conflict, "conflicting run options from device plugins");
        }
        Ok(merged)
    }

    /// Waits until what `undo` recorded is on disk; if it cannot be, undoes
    /// it (and writes the undo).
    async fn commit(&self, mut undo: Undo<'_>) -> Result<(), AllocateError> {
        if undo.added.is_empty() {
            return Ok(());
        }
        if let Err(error) = self.persisted().await {
            drop(undo);
            // The undo must reach the disk too; its own failure is logged
            // by the writer and reported through its health check.
            let _ = self.persisted().await;
            tracing::error!(%error, "allocation undone: the checkpoint could not be written");
            return Err(AllocateError::Checkpoint(error));
        }
        undo.added.clear();
        Ok(())
    }

    /// Frees every device held by the pod's containers. Returns how many.
    /// The checkpoint is rewritten in the background (see
    /// [`persisted`](Self::persisted)); after a crash in between, the pod's
    /// devices come back allocated until it is freed again.
    pub fn free_pod(&self, pod_uid: &str) -> usize {
        let freed = self.allocations().remove_pod(pod_uid);
        if freed > 0 {
            tracing::info!(pod.uid = pod_uid, devices = freed, "devices freed");
            self.request_checkpoint();
        }
        freed
    }

    /// Frees every pod not in `live` (the pods the node still runs; after a
    /// restart, what the checkpoint holds of other pods is orphaned).
    /// Returns the pods freed, with how many devices each held. The
    /// checkpoint is rewritten in the background, as for
    /// [`free_pod`](Self::free_pod).
    pub fn retain_pods<'a>(&self, live: impl IntoIterator<Item = &'a str>) -> BTreeMap<String, usize> {
        let live: HashSet<&str> = live.into_iter().collect();
        let freed = self.allocations().retain_pods(&live);
        if !freed.is_empty() {
            for (pod, devices) in &freed {
                tracing::info!(pod.uid = %pod, devices, "devices of a pod no longer on the node freed");
            }
            self.request_checkpoint();
        }
        freed
    }

    /// The devices a container holds, by resource.
    pub fn allocated(&self, pod_uid: &str, container: &str) -> BTreeMap<String, Vec<String>> {
        self.allocations()
            .container(pod_uid, container)
            .map(|r| r.resources.iter().map(|(k, v)| (k.clone(), v.device_ids.clone())).collect())
            .unwrap_or_default()
    }

    pub(super) fn allocations(&self) -> std::sync::MutexGuard<'_, Allocations> {
        // As for the device state: short critical sections, no await inside.
        self.inner.allocations.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Healthy devices of `resource`, its plugin, and the choice when the
    /// plugin has no preference to give; `Ok(None)` when no device plugin
    /// ever registered the resource.
    fn plan(&self, request: &ContainerRequest, resource: &str, count: u64) -> Result<Option<Plan>, AllocateError> {
        let resources = self.lock();
        let Some(entry) = resources.get(resource) else { return Ok(None) };
        if entry.endpoint.is_none() && entry.devices.is_empty() {
            return Err(AllocateError::Unregistered(resource.to_owned()));
        }
        let Some(endpoint) =
            entry.endpoint.as_ref().filter(|_| entry.devices.values().any(|d| d.health == Health::Healthy))
        else {
            return Err(AllocateError::NoHealthy(resource.to_owned()));
        };
        let options = entry.options.unwrap_or_default();
        let (client, calls) = (DevicePluginClient::new(endpoint.channel.clone()), endpoint.calls.clone());
        let mut allocations = self.allocations();
        let choice = if options.get_preferred_allocation_available {
            let free = free_devices(&entry.devices, &allocations, resource, &request.pod_uid);
            check_available(resource, count, free.len())?;
            let must = allocations.reusable(resource, &request.pod_uid);
            Choice::AskPlugin { available: free.iter().map(|f| f.id.to_owned()).collect(), must }
        } else {
            Choice::Made(choose_and_reserve(&entry.devices, &mut allocations, request, resource, count, &[])?)
        };
        Ok(Some(Plan { choice, client, calls }))
    }

    /// Chooses against the state as it is now (other allocations may have
    /// run while the plugin was asked) and reserves the devices.
    fn choose_now(
        &self,
        request: &ContainerRequest,
        resource: &str,
        count: u64,
        preferred: &[String],
    ) -> Result<Chosen, AllocateError> {
        let resources = self.lock();
        let no_devices = BTreeMap::new();
        let devices = resources.get(resource).map_or(&no_devices, |r| &r.devices);
        choose_and_reserve(devices, &mut self.allocations(), request, resource, count, preferred)
    }

    async fn allocate_resource(
        &self,
        request: &ContainerRequest,
        resource: &str,
        count: u64,
    ) -> Result<Option<Step>, AllocateError> {
        if let Some(held) = self.allocations().held(&request.pod_uid, &request.container_name, resource) {
            let had = held.device_ids.len() as u64;
            if had == count {
                return Ok(Some(Step::Existing(held.options.clone())));
            }
            return Err(AllocateError::ChangedRequest {
                pod: request.pod_name.clone(),
                container: request.container_name.clone(),
                resource: resource.to_owned(),
                from: had,
                to: count,
            });
        }
        let Some(Plan { choice, mut client, calls }) = self.plan(request, resource, count)? else {
            return Ok(None);
        };
        let mut reservation = Reservation { manager: self, resource, ids: Vec::new() };
        if let Choice::Made(chosen) = &choice {
            reservation.ids = ids_of(chosen);
        }
        // Fails only if the semaphore is closed, which never happens; then
        // the call simply goes unbounded.
        let _permit = calls.acquire_owned().await.ok();
        let chosen = match choice {
            Choice::Made(chosen) => chosen,
            Choice::AskPlugin { available, must } => {
                let ask = api::PreferredAllocationRequest {
                    container_requests: vec![api::ContainerPreferredAllocationRequest {
                        available_device_i_ds: available,
                        must_include_device_i_ds: must,
                        allocation_size: count as i32,
                    }],
                };
                let timeout = self.inner.config.call_timeout;
                let preferred = match call(timeout, client.get_preferred_allocation(ask)).await {
                    Ok(answer) => {
                        answer.container_responses.into_iter().next().map(|c| c.device_i_ds).unwrap_or_default()
                    }
                    Err(failure) => {
                        let error = AllocateError::of_call(resource, "GetPreferredAllocation", failure);
                        tracing::warn!(resource, %error, "preferred allocation unavailable; choosing without it");
                        Vec::new()
                    }
                };
                let chosen = self.choose_now(request, resource, count, &preferred)?;
                reservation.ids = ids_of(&chosen);
                chosen
            }
        };
        // On an error the reservation is released as it goes out of scope.
        let run_options = self.call_allocate(resource, &mut client, &reservation.ids).await?;
        let encoded =
            Part::entry(&request.pod_uid, &request.container_name, resource, request.kind, &chosen, &run_options)
                .map_err(AllocateError::Checkpoint)?;
        // Taking the IDs disarms the reservation: the caller records the
        // allocation right away (no await in between), which turns the
        // reservation into a holding.
        let device_ids = std::mem::take(&mut reservation.ids);
        Ok(Some(Step::New(Held { device_ids, options: run_options, encoded: Arc::new(encoded) })))
    }

    async fn call_allocate(
        &self,
        resource: &str,
        client: &mut DevicePluginClient<kubelet_api::uds::UdsChannel>,
        ids: &[String],
    ) -> Result<RunOptions, AllocateError> {
        let request = api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest { devices_ids: ids.to_vec() }],
        };
        let started = std::time::Instant::now();
        let response = call(self.inner.config.call_timeout, client.allocate(request)).await;
        self.inner.metrics.allocate_call(resource, started.elapsed());
        let response = response.map_err(|failure| AllocateError::of_call(resource, "Allocate", failure))?;
        let count = response.container_responses.len();
        let Some(answer) = response.container_responses.into_iter().next().filter(|_| count == 1) else {
            return Err(AllocateError::BadResponse {
                resource: resource.to_owned(),
                reason: format!("expected 1 container response, got {count}"),
            });
        };
        Ok(answer.into())
    }
}

/// The containers in the order they are allocated: init containers, then
/// sidecars, then app containers, each kind in the order given.
fn allocation_order(containers: &[PodContainer]) -> Vec<&PodContainer> {
    let rank = |kind| match kind {
        ContainerKind::Init => 0,
        ContainerKind::RestartableInit => 1,
        ContainerKind::App | ContainerKind::Ephemeral => 2,
    };
    let mut order: Vec<&PodContainer> = containers.iter().collect();
    // A stable sort: the order given is kept within a kind.
    order.sort_by_key(|c| rank(c.kind));
    order
}

/// Devices reserved for an allocation in progress; released when dropped
/// unless taken (the allocation is being recorded), so an allocation that
/// fails or whose caller gives up midway does not keep devices reserved.
struct Reservation<'a> {
    manager: &'a DeviceManager,
    resource: &'a str,
    ids: Vec<String>,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.manager.allocations().unreserve(self.resource, &self.ids);
        }
    }
}

/// What one allocation call recorded (pod, container, resource), removed
/// again when dropped unless emptied (the call completed).
struct Undo<'a> {
    manager: &'a DeviceManager,
    added: Vec<(String, String, String)>,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.added.is_empty() {
            let mut allocations = self.manager.allocations();
            for (pod, container, resource) in &self.added {
                allocations.remove(pod, container, resource);
            }
            drop(allocations);
            // A write may have covered them; the next one must not.
            self.manager.request_checkpoint();
        }
    }
}

fn check_available(resource: &str, requested: u64, available: usize) -> Result<(), AllocateError> {
    if (available as u64) < requested {
        return Err(AllocateError::Unavailable { resource: resource.to_owned(), requested, available });
    }
    Ok(())
}

/// Chooses `count` free healthy devices of `resource` for the request
/// (reused init-container devices first, then `preferred`, then a NUMA-aligned
/// fill) and reserves them.
fn choose_and_reserve(
    devices: &BTreeMap<String, Device>,
    allocations: &mut Allocations,
    request: &ContainerRequest,
    resource: &str,
    count: u64,
    preferred: &[String],
) -> Result<Chosen, AllocateError> {
    let free = free_devices(devices, allocations, resource, &request.pod_uid);
    check_available(resource, count, free.len())?;
    let must = allocations.reusable(resource, &request.pod_uid);
    let chosen: Chosen = choose(&free, &must, preferred, count as usize)
        .into_iter()
        .map(|at| (free[at].id.to_owned(), free[at].primary_numa()))
        .collect();
    allocations.reserve(resource, &ids_of(&chosen));
    Ok(chosen)
}

fn ids_of(chosen: &Chosen) -> Vec<String> {
    chosen.iter().map(|(id, _)| id.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(name: &str, kind: ContainerKind) -> PodContainer {
        PodContainer { name: name.into(), kind, limits: BTreeMap::new() }
    }

    #[test]
    fn init_containers_first_then_sidecars_then_apps_each_in_the_order_given() {
        use ContainerKind::{App, Init, RestartableInit};
        let containers = [
            container("app-b", App),
            container("init-2", Init),
            container("sidecar", RestartableInit),
            container("app-a", App),
            container("init-1", Init),
        ];
        let order: Vec<&str> = allocation_order(&containers).into_iter().map(|c| c.name.as_str()).collect();
        assert_eq!(order, ["init-2", "init-1", "sidecar", "app-b", "app-a"]);
    }
}
