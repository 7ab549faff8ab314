//! Allocating devices to containers.
//!
//! # Flow, per device-plugin resource in the container's limits
//! 1. Same count already allocated to this container: reuse it (idempotent);
//!    a different count is an error.
//! 2. Under the locks: find the free healthy devices and the ones this pod's
//!    earlier init containers hold (reusable); too few is an error. Unless
//!    the plugin offers `GetPreferredAllocation`, choose (see `allocation`)
//!    and reserve the devices right away.
//! 3. Without the locks: `GetPreferredAllocation` when the plugin offers it;
//!    then, under the locks, choose against the state as it is now and
//!    reserve.
//! 4. Without the locks: `Allocate` (one container, deadline), then
//!    `PreStartContainer` when the plugin asked for it; the checkpoint entry
//!    is encoded.
//! 5. Under the lock: record the allocation, or release the reservation.
//! 6. Wait for the checkpoint write that covers it (shared with concurrent
//!    allocations).
//!
//! # Cost
//! Devices in use are indexed per resource and kept sorted, so finding the
//! free ones is one walk over the resource's devices, whatever the number of
//! allocations on the node; a checkpoint entry is encoded once, when its
//! allocation is made.
//!
//! No lock is held across a call to a plugin: concurrent allocations wait
//! for each other only while one chooses (a walk over its resource's
//! devices), and for a free slot when 128 calls to the same plugin are in
//! flight. A failure leaves nothing recorded: this container's other
//! resources allocated in the same call are released too. So does a call
//! whose caller drops it midway (its reservations are released, and what it
//! recorded is removed and the removal checkpointed).
//!
//! # Guarantees
//! - App containers of a pod never share devices; a pod's (non-restartable)
//!   init containers' devices are reused by its later containers; sidecars
//!   (restartable init containers) keep theirs.
//!
//! # Caveats
//! - `free_pod` rewrites the checkpoint in the background: after a crash in
//!   between, the freed pod's devices come back allocated until it is freed
//!   again.
//! - A `GetPreferredAllocation` that fails or times out is logged and the
//!   node chooses by itself.
//! - Two concurrent calls for the same container: the second may return the
//!   first's run options before they are on disk, and keep them if the
//!   first's checkpoint write then fails. The pod lifecycle makes one call
//!   per container at a time.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use kubelet_api::deviceplugin::v1beta1 as api;
use kubelet_api::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;

use super::allocation::{Free, choose};
use super::checkpoint::Part;
use super::devices::{Device, Health, PluginOptions};
use super::run_options::RunOptions;
use super::{DeviceManager, call};

/// What kind of container asks for devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ContainerKind {
    /// An init container that runs to completion before the next one.
    Init,
    /// A restartable init container (sidecar): runs alongside the app containers.
    RestartableInit,
    /// An app container.
    App,
}

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
    /// The allocation could not be made durable; it was undone.
    #[error("cannot write the device checkpoint: {0}")]
    Checkpoint(String),
}

/// What a container holds of one resource.
#[derive(Clone, Debug)]
pub(crate) struct Held {
    pub(crate) device_ids: Vec<String>,
    pub(crate) options: RunOptions,
    /// Its checkpoint entry, encoded once.
    pub(crate) encoded: Arc<Part>,
}

/// One container's allocations.
#[derive(Clone, Debug)]
pub(crate) struct ContainerRecord {
    pub(crate) kind: ContainerKind,
    pub(crate) resources: BTreeMap<String, Held>,
}

/// A container holding a device.
#[derive(Debug)]
struct Holder {
    pod: String,
    container: String,
    /// A (non-restartable) init container: its pod's later containers may
    /// reuse the device.
    init: bool,
}

/// Who uses a device: the containers holding it (more than one only when a
/// pod's containers reuse its init containers' devices), and whether an
/// allocation in progress reserved it.
#[derive(Debug, Default)]
struct Use {
    holders: Vec<Holder>,
    reserved: bool,
}

impl Use {
    /// Unavailable to `pod`: reserved, or held by anyone but the pod's init
    /// containers.
    fn taken_for(&self, pod: &str) -> bool {
        self.reserved || self.holders.iter().any(|h| !(h.init && h.pod == pod))
    }
}

/// Every allocation, indexed by device, and devices reserved by allocations
/// in progress. A resource's free devices are found by walking its device
/// list alongside its (sorted) used devices, whatever the number of
/// allocations on the node.
#[derive(Default)]
pub(crate) struct Allocations {
    pods: BTreeMap<String, BTreeMap<String, ContainerRecord>>,
    /// Resource → device → its use; devices nobody uses are absent.
    uses: HashMap<String, BTreeMap<String, Use>>,
}

impl Allocations {
    /// Allocations restored from a checkpoint.
    pub(crate) fn restored(pods: BTreeMap<String, BTreeMap<String, ContainerRecord>>) -> Self {
        let mut allocations = Allocations::default();
        for (pod, containers) in &pods {
            for (container, record) in containers {
                for (resource, held) in &record.resources {
                    allocations.hold(pod, container, record.kind, resource, &held.device_ids);
                }
            }
        }
        allocations.pods = pods;
        allocations
    }

    fn hold(&mut self, pod: &str, container: &str, kind: ContainerKind, resource: &str, ids: &[String]) {
        let devices = self.uses.entry(resource.to_owned()).or_default();
        for id in ids {
            let holders = &mut devices.entry(id.clone()).or_default().holders;
            if !holders.iter().any(|h| h.pod == pod && h.container == container) {
                holders.push(Holder {
                    pod: pod.to_owned(),
                    container: container.to_owned(),
                    init: kind == ContainerKind::Init,
                });
            }
        }
    }

    /// Applies `change` to the use of each of `ids`, dropping uses left empty.
    fn change_uses(&mut self, resource: &str, ids: &[String], change: impl Fn(&mut Use)) {
        let Some(devices) = self.uses.get_mut(resource) else { return };
        for id in ids {
            if let Some(device) = devices.get_mut(id) {
                change(device);
                if device.holders.is_empty() && !device.reserved {
                    devices.remove(id);
                }
            }
        }
    }

    fn unhold(&mut self, pod: &str, container: &str, resource: &str, ids: &[String]) {
        self.change_uses(resource, ids, |u| u.holders.retain(|h| h.pod != pod || h.container != container));
    }

    /// What the container holds of `resource`.
    fn held(&self, pod: &str, container: &str, resource: &str) -> Option<&Held> {
        self.pods.get(pod)?.get(container)?.resources.get(resource)
    }

    /// Records an allocation; its devices are no longer merely reserved.
    fn insert(&mut self, request: &ContainerRequest, resource: &str, held: Held) {
        let (pod, container) = (&request.pod_uid, &request.container_name);
        self.unreserve(resource, &held.device_ids);
        let kind = self.pods.get(pod).and_then(|c| c.get(container)).map_or(request.kind, |r| r.kind);
        // A different count than before is refused earlier; a replacement
        // is kept consistent regardless.
        if let Some(old) = self.held(pod, container, resource).map(|h| h.device_ids.clone()) {
            self.unhold(pod, container, resource, &old);
        }
        self.hold(pod, container, kind, resource, &held.device_ids);
        self.pods
            .entry(pod.clone())
            .or_default()
            .entry(container.clone())
            .or_insert_with(|| ContainerRecord { kind, resources: BTreeMap::new() })
            .resources
            .insert(resource.to_owned(), held);
    }

    /// Removes the container's allocations of `resources`.
    fn remove(&mut self, pod: &str, container: &str, resources: &[String]) {
        let Some(record) = self.pods.get_mut(pod).and_then(|c| c.get_mut(container)) else { return };
        let removed: Vec<(String, Held)> =
            resources.iter().filter_map(|r| record.resources.remove(r).map(|h| (r.clone(), h))).collect();
        for (resource, held) in removed {
            self.unhold(pod, container, &resource, &held.device_ids);
        }
    }

    /// Removes every allocation of the pod; returns how many devices it held.
    fn remove_pod(&mut self, pod: &str) -> usize {
        let Some(containers) = self.pods.remove(pod) else { return 0 };
        let mut freed = 0;
        for (container, record) in &containers {
            for (resource, held) in &record.resources {
                self.unhold(pod, container, resource, &held.device_ids);
                freed += held.device_ids.len();
            }
        }
        freed
    }

    /// Whether device `id` of `resource` is unavailable to `pod`: reserved,
    /// or held by anyone but the pod's init containers.
    fn is_taken(&self, resource: &str, pod: &str, id: &str) -> bool {
        self.uses.get(resource).and_then(|d| d.get(id)).is_some_and(|u| u.taken_for(pod))
    }

    /// Devices of `resource` the pod's init containers hold and nobody else
    /// does: its later containers must reuse them.
    fn reusable(&self, resource: &str, pod: &str) -> Vec<String> {
        let Some(containers) = self.pods.get(pod) else { return Vec::new() };
        let mut ids: Vec<String> = containers
            .values()
            .filter(|r| r.kind == ContainerKind::Init)
            .filter_map(|r| r.resources.get(resource))
            .flat_map(|h| h.device_ids.iter())
            .filter(|id| !self.is_taken(resource, pod, id))
            .cloned()
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    fn reserve(&mut self, resource: &str, ids: &[String]) {
        let devices = self.uses.entry(resource.to_owned()).or_default();
        for id in ids {
            devices.entry(id.clone()).or_default().reserved = true;
        }
    }

    fn unreserve(&mut self, resource: &str, ids: &[String]) {
        self.change_uses(resource, ids, |u| u.reserved = false);
    }

    /// The checkpoint entries, in pod, container, resource order.
    pub(crate) fn parts(&self) -> Vec<Arc<Part>> {
        self.pods
            .values()
            .flat_map(|containers| containers.values())
            .flat_map(|record| record.resources.values())
            .map(|held| held.encoded.clone())
            .collect()
    }
}

/// The free healthy devices of a resource for `pod`, sorted by ID: the
/// device list and the used devices are both sorted, so one walk over the
/// two finds them.
fn free_devices<'a>(
    devices: &'a BTreeMap<String, Device>,
    allocations: &Allocations,
    resource: &str,
    pod: &str,
) -> Vec<Free<'a>> {
    let mut used = allocations.uses.get(resource).into_iter().flatten().peekable();
    let mut free = Vec::with_capacity(devices.len());
    for device in devices.values() {
        while used.next_if(|(id, _)| id.as_str() < device.id.as_str()).is_some() {}
        let taken = used.peek().is_some_and(|(id, u)| **id == device.id && u.taken_for(pod));
        if device.health == Health::Healthy && !taken {
            free.push(Free { id: &device.id, numa: &device.numa_nodes });
        }
    }
    free
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
    options: PluginOptions,
    calls: Arc<tokio::sync::Semaphore>,
}

enum Step {
    /// Already allocated with the same count.
    Existing(RunOptions),
    /// Newly allocated.
    New(Held),
}

const PRE_START_TIMEOUT: Duration = Duration::from_secs(30);

impl DeviceManager {
    /// Allocates the devices of every device-plugin resource in the
    /// container's limits and returns the merged run options.
    pub async fn allocate(&self, request: &ContainerRequest) -> Result<RunOptions, AllocateError> {
        let span = tracing::info_span!(
            "allocate",
            pod.uid = %request.pod_uid,
            pod = %request.pod_name,
            container = %request.container_name
        );
        let mut merged = RunOptions::default();
        // Undoes what this call recorded unless it completes: on an error,
        // and when the caller drops the call midway.
        let mut undo = Undo { manager: self, request, added: Vec::new() };
        for (resource, &count) in &request.limits {
            if count == 0 {
                continue;
            }
            match self.allocate_resource(request, resource, count).await {
                Ok(None) => {}
                Ok(Some(Step::Existing(options))) => merged.merge(resource, &options),
                Ok(Some(Step::New(held))) => {
                    merged.merge(resource, &held.options);
                    tracing::info!(parent: &span, resource, devices = ?held.device_ids, "devices allocated");
                    self.allocations().insert(request, resource, held);
                    undo.added.push(resource.clone());
                }
                Err(error) => {
                    tracing::warn!(parent: &span, resource, %error, "device allocation failed");
                    return Err(error);
                }
            }
        }
        if !undo.added.is_empty()
            && let Err(error) = self.persisted().await
        {
            drop(undo);
            // The undo must reach the disk too; its own failure is logged.
            let _ = self.persisted().await;
            tracing::error!(parent: &span, %error, "allocation undone: the checkpoint could not be written");
            return Err(AllocateError::Checkpoint(error));
        }
        undo.added.clear();
        for conflict in &merged.conflicts {
            tracing::warn!(parent: &span, conflict, "conflicting run options from device plugins");
        }
        Ok(merged)
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

    /// The devices a container holds, by resource.
    pub fn allocated(&self, pod_uid: &str, container: &str) -> BTreeMap<String, Vec<String>> {
        self.allocations()
            .pods
            .get(pod_uid)
            .and_then(|c| c.get(container))
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
        let (options, client, calls) =
            (endpoint.options, DevicePluginClient::new(endpoint.channel.clone()), endpoint.calls.clone());
        let mut allocations = self.allocations();
        let choice = if options.get_preferred_allocation_available {
            let free = free_devices(&entry.devices, &allocations, resource, &request.pod_uid);
            check_available(resource, count, free.len())?;
            let must = allocations.reusable(resource, &request.pod_uid);
            Choice::AskPlugin { available: free.iter().map(|f| f.id.to_owned()).collect(), must }
        } else {
            Choice::Made(choose_and_reserve(&entry.devices, &mut allocations, request, resource, count, &[])?)
        };
        Ok(Some(Plan { choice, client, options, calls }))
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
        let Some(Plan { choice, mut client, options, calls }) = self.plan(request, resource, count)? else {
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
                let preferred =
                    match call(resource, "GetPreferredAllocation", timeout, client.get_preferred_allocation(ask)).await
                    {
                        Ok(answer) => {
                            answer.container_responses.into_iter().next().map(|c| c.device_i_ds).unwrap_or_default()
                        }
                        Err(error) => {
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
        let run_options = self.call_plugin(resource, &mut client, options, &reservation.ids).await?;
        let encoded =
            Part::entry(&request.pod_uid, &request.container_name, resource, request.kind, &chosen, &run_options);
        // Taking the IDs disarms the reservation: the caller records the
        // allocation right away (no await in between), which turns the
        // reservation into a holding.
        let device_ids = std::mem::take(&mut reservation.ids);
        Ok(Some(Step::New(Held { device_ids, options: run_options, encoded: Arc::new(encoded) })))
    }

    async fn call_plugin(
        &self,
        resource: &str,
        client: &mut DevicePluginClient<kubelet_api::uds::UdsChannel>,
        options: PluginOptions,
        ids: &[String],
    ) -> Result<RunOptions, AllocateError> {
        let timeout = self.inner.config.call_timeout;
        let to_error = |e: super::RegisterError| match e {
            super::RegisterError::Timeout { rpc, timeout, .. } => {
                AllocateError::Timeout { resource: resource.to_owned(), rpc, timeout }
            }
            super::RegisterError::Rpc { rpc, status, .. } => {
                AllocateError::Rpc { resource: resource.to_owned(), rpc, status }
            }
            other => AllocateError::BadResponse { resource: resource.to_owned(), reason: other.to_string() },
        };
        let request = api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest { devices_ids: ids.to_vec() }],
        };
        let started = std::time::Instant::now();
        let response = call(resource, "Allocate", timeout, client.allocate(request)).await;
        self.inner.metrics.allocate_call(resource, started.elapsed());
        let response = response.map_err(to_error)?;
        let count = response.container_responses.len();
        let Some(answer) = response.container_responses.into_iter().next().filter(|_| count == 1) else {
            return Err(AllocateError::BadResponse {
                resource: resource.to_owned(),
                reason: format!("expected 1 container response, got {count}"),
            });
        };
        if options.pre_start_required {
            let request = api::PreStartContainerRequest { devices_ids: ids.to_vec() };
            call(resource, "PreStartContainer", PRE_START_TIMEOUT, client.pre_start_container(request))
                .await
                .map_err(to_error)?;
        }
        Ok(answer.into())
    }
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

/// The resources one `allocate` call recorded, removed again when dropped
/// unless emptied (the call completed).
struct Undo<'a> {
    manager: &'a DeviceManager,
    request: &'a ContainerRequest,
    added: Vec<String>,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.added.is_empty() {
            self.manager.allocations().remove(&self.request.pod_uid, &self.request.container_name, &self.added);
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

    /// The old way: walk every allocation.
    fn brute_force_taken(a: &Allocations, resource: &str, pod: &str, id: &str) -> bool {
        a.uses.get(resource).and_then(|d| d.get(id)).is_some_and(|u| u.reserved)
            || a.pods.iter().any(|(uid, containers)| {
                containers.values().any(|record| {
                    record.resources.get(resource).is_some_and(|held| {
                        held.device_ids.iter().any(|d| d == id) && !(uid == pod && record.kind == ContainerKind::Init)
                    })
                })
            })
    }

    fn held(pod: &str, container: &str, resource: &str, kind: ContainerKind, ids: &[String]) -> Held {
        let devices: Vec<(String, i64)> = ids.iter().map(|id| (id.clone(), 0)).collect();
        let options = RunOptions::default();
        let encoded = Arc::new(Part::entry(pod, container, resource, kind, &devices, &options));
        Held { device_ids: ids.to_vec(), options, encoded }
    }

    fn request(pod: &str, container: &str, kind: ContainerKind) -> ContainerRequest {
        ContainerRequest {
            pod_uid: pod.into(),
            pod_name: pod.into(),
            container_name: container.into(),
            kind,
            limits: BTreeMap::new(),
        }
    }

    /// Random inserts, removals, pod frees, reservations and a restore: the
    /// index always answers as a walk over every allocation would.
    #[test]
    fn the_device_index_agrees_with_a_full_scan() {
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let kinds = [ContainerKind::Init, ContainerKind::RestartableInit, ContainerKind::App];
        let resources = ["r/a", "r/b"];
        let devices: BTreeMap<String, Device> = (0..12)
            .map(|d| {
                let health = if d % 5 == 3 { Health::Unhealthy } else { Health::Healthy };
                (format!("d{d}"), Device { id: format!("d{d}"), health, numa_nodes: vec![d % 2] })
            })
            .collect();
        let mut a = Allocations::default();
        for step in 0..3000 {
            let pod = format!("p{}", next(6));
            let container = format!("c{}", next(3));
            let resource = resources[next(2) as usize];
            match next(10) {
                0..=4 => {
                    let ids: Vec<String> = (0..1 + next(3)).map(|_| format!("d{}", next(12))).collect();
                    let kind = kinds[next(3) as usize];
                    let held = held(&pod, &container, resource, kind, &ids);
                    a.insert(&request(&pod, &container, kind), resource, held);
                }
                5 | 6 => a.remove(&pod, &container, &[resource.to_owned()]),
                7 => {
                    a.remove_pod(&pod);
                }
                8 => a.reserve(resource, &[format!("d{}", next(12))]),
                _ => a.unreserve(resource, &[format!("d{}", next(12))]),
            }
            if step == 1500 {
                let reserved: Vec<(String, Vec<String>)> = a
                    .uses
                    .iter()
                    .map(|(r, d)| (r.clone(), d.iter().filter(|(_, u)| u.reserved).map(|(id, _)| id.clone()).collect()))
                    .collect();
                a = Allocations::restored(std::mem::take(&mut a.pods));
                for (resource, ids) in reserved {
                    a.reserve(&resource, &ids);
                }
            }
            for resource in resources {
                for pod in (0..6).map(|p| format!("p{p}")) {
                    let mut reusable: Vec<String> = a
                        .pods
                        .get(&pod)
                        .into_iter()
                        .flat_map(|c| c.values())
                        .filter(|r| r.kind == ContainerKind::Init)
                        .filter_map(|r| r.resources.get(resource))
                        .flat_map(|h| h.device_ids.iter().cloned())
                        .filter(|id| !brute_force_taken(&a, resource, &pod, id))
                        .collect();
                    reusable.sort();
                    reusable.dedup();
                    assert_eq!(a.reusable(resource, &pod), reusable, "step {step}: reusable {resource} for {pod}");
                    let free: Vec<&str> =
                        free_devices(&devices, &a, resource, &pod).into_iter().map(|f| f.id).collect();
                    let expected: Vec<&str> = devices
                        .values()
                        .filter(|d| d.health == Health::Healthy && !brute_force_taken(&a, resource, &pod, &d.id))
                        .map(|d| d.id.as_str())
                        .collect();
                    assert_eq!(free, expected, "step {step}: free {resource} for {pod}");
                    for id in (0..12).map(|d| format!("d{d}")) {
                        assert_eq!(
                            a.is_taken(resource, &pod, &id),
                            brute_force_taken(&a, resource, &pod, &id),
                            "step {step}: {resource} {id} for {pod}"
                        );
                    }
                }
            }
        }
        // Every holder entry belongs to a recorded allocation.
        let held_total: usize = a.uses.values().flat_map(|d| d.values()).map(|u| u.holders.len()).sum();
        let recorded: usize = a
            .pods
            .values()
            .flat_map(|c| c.values())
            .flat_map(|r| r.resources.values())
            .map(|h| h.device_ids.iter().collect::<std::collections::BTreeSet<_>>().len())
            .sum();
        assert_eq!(held_total, recorded, "no stale holders");
    }
}
