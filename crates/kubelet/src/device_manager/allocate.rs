//! Allocating devices to containers.
//!
//! # Flow, per device-plugin resource in the container's limits
//! 1. Same count already allocated to this container: reuse it (idempotent);
//!    a different count is an error.
//! 2. Under the lock: find the free healthy devices and the ones this pod's
//!    earlier init containers hold (reusable); too few is an error.
//! 3. Without the lock: `GetPreferredAllocation` when the plugin offers it.
//! 4. Under the lock: choose (see `allocation`), and reserve the devices.
//! 5. Without the lock: `Allocate` (one container, deadline), then
//!    `PreStartContainer` when the plugin asked for it.
//! 6. Under the lock: record the allocation, or release the reservation.
//!
//! No lock is held across a call to a plugin, so concurrent allocations only
//! wait for each other for a few map operations. A failure leaves nothing
//! recorded: this container's other resources allocated in the same call are
//! released too.
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

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kubelet_api::deviceplugin::v1beta1 as api;
use kubelet_api::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;

use super::allocation::{Free, choose};
use super::devices::{Health, PluginOptions};
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
}

/// One container's allocations.
#[derive(Clone, Debug)]
pub(crate) struct ContainerRecord {
    pub(crate) kind: ContainerKind,
    pub(crate) resources: BTreeMap<String, Held>,
}

/// Every allocation, and devices reserved by allocations in progress.
#[derive(Default)]
pub(crate) struct Allocations {
    pub(crate) pods: BTreeMap<String, BTreeMap<String, ContainerRecord>>,
    reserved: BTreeMap<String, BTreeSet<String>>,
}

impl Allocations {
    /// Allocations restored from a checkpoint.
    pub(crate) fn restored(pods: BTreeMap<String, BTreeMap<String, ContainerRecord>>) -> Self {
        Allocations { pods, reserved: BTreeMap::new() }
    }
}

impl Allocations {
    /// Devices of `resource` not available to `pod`: held by anyone but the
    /// pod's init containers, or reserved; and the ones `pod` may reuse.
    fn taken_and_reusable(&self, resource: &str, pod: &str) -> (BTreeSet<String>, BTreeSet<String>) {
        let mut taken: BTreeSet<String> = self.reserved.get(resource).cloned().unwrap_or_default();
        let mut reusable = BTreeSet::new();
        for (uid, containers) in &self.pods {
            for record in containers.values() {
                let Some(held) = record.resources.get(resource) else { continue };
                if uid == pod && record.kind == ContainerKind::Init {
                    reusable.extend(held.device_ids.iter().cloned());
                } else {
                    taken.extend(held.device_ids.iter().cloned());
                }
            }
        }
        reusable.retain(|id| !taken.contains(id));
        (taken, reusable)
    }
}

/// What the lock-free part of an allocation needs.
struct Plan {
    free: Vec<Free>,
    must: Vec<String>,
    client: DevicePluginClient<kubelet_api::uds::UdsChannel>,
    options: PluginOptions,
    calls: std::sync::Arc<tokio::sync::Semaphore>,
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
        let mut added = Vec::new();
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
                    self.record(request, resource, held);
                    added.push(resource.clone());
                }
                Err(error) => {
                    self.forget(request, &added);
                    tracing::warn!(parent: &span, resource, %error, "device allocation failed");
                    return Err(error);
                }
            }
        }
        if !added.is_empty()
            && let Err(error) = self.persisted().await
        {
            self.forget(request, &added);
            // The undo must reach the disk too; its own failure is logged.
            let _ = self.persisted().await;
            tracing::error!(parent: &span, %error, "allocation undone: the checkpoint could not be written");
            return Err(AllocateError::Checkpoint(error));
        }
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
        let removed = self.allocations().pods.remove(pod_uid);
        let freed = removed
            .map(|containers| {
                containers.values().map(|c| c.resources.values().map(|h| h.device_ids.len()).sum::<usize>()).sum()
            })
            .unwrap_or(0);
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

    fn record(&self, request: &ContainerRequest, resource: &str, held: Held) {
        let mut allocations = self.allocations();
        if let Some(reserved) = allocations.reserved.get_mut(resource) {
            for id in &held.device_ids {
                reserved.remove(id);
            }
        }
        allocations
            .pods
            .entry(request.pod_uid.clone())
            .or_default()
            .entry(request.container_name.clone())
            .or_insert_with(|| ContainerRecord { kind: request.kind, resources: BTreeMap::new() })
            .resources
            .insert(resource.to_owned(), held);
    }

    fn forget(&self, request: &ContainerRequest, resources: &[String]) {
        let mut allocations = self.allocations();
        if let Some(record) =
            allocations.pods.get_mut(&request.pod_uid).and_then(|c| c.get_mut(&request.container_name))
        {
            for resource in resources {
                record.resources.remove(resource);
            }
        }
    }

    fn release(&self, resource: &str, ids: &[String]) {
        if let Some(reserved) = self.allocations().reserved.get_mut(resource) {
            for id in ids {
                reserved.remove(id);
            }
        }
    }

    /// Healthy devices of `resource`, and its plugin; `Ok(None)` when no
    /// device plugin ever registered the resource.
    fn plan(&self, request: &ContainerRequest, resource: &str, count: u64) -> Result<Option<Plan>, AllocateError> {
        let (healthy, endpoint) = {
            let resources = self.lock();
            let Some(entry) = resources.get(resource) else { return Ok(None) };
            if entry.endpoint.is_none() && entry.devices.is_empty() {
                return Err(AllocateError::Unregistered(resource.to_owned()));
            }
            let healthy: Vec<Free> = entry
                .devices
                .values()
                .filter(|d| d.health == Health::Healthy)
                .map(|d| Free { id: d.id.clone(), numa: d.numa_nodes.clone() })
                .collect();
            (healthy, entry.endpoint.as_ref().map(|e| (e.channel.clone(), e.options, e.calls.clone())))
        };
        let Some((channel, options, calls)) = endpoint.filter(|_| !healthy.is_empty()) else {
            return Err(AllocateError::NoHealthy(resource.to_owned()));
        };
        let (taken, reusable) = self.allocations().taken_and_reusable(resource, &request.pod_uid);
        let free: Vec<Free> = healthy.into_iter().filter(|f| !taken.contains(&f.id)).collect();
        if (free.len() as u64) < count {
            return Err(AllocateError::Unavailable {
                resource: resource.to_owned(),
                requested: count,
                available: free.len(),
            });
        }
        let must = free.iter().filter(|f| reusable.contains(&f.id)).map(|f| f.id.clone()).collect();
        Ok(Some(Plan { free, must, client: DevicePluginClient::new(channel), options, calls }))
    }

    async fn allocate_resource(
        &self,
        request: &ContainerRequest,
        resource: &str,
        count: u64,
    ) -> Result<Option<Step>, AllocateError> {
        if let Some(held) = self
            .allocations()
            .pods
            .get(&request.pod_uid)
            .and_then(|c| c.get(&request.container_name))
            .and_then(|r| r.resources.get(resource))
        {
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
        let Some(Plan { free, must, mut client, options, calls }) = self.plan(request, resource, count)? else {
            return Ok(None);
        };
        // Fails only if the semaphore is closed, which never happens; then
        // the call simply goes unbounded.
        let _permit = calls.acquire_owned().await.ok();
        let timeout = self.inner.config.call_timeout;
        let preferred = if options.get_preferred_allocation_available {
            let ask = api::PreferredAllocationRequest {
                container_requests: vec![api::ContainerPreferredAllocationRequest {
                    available_device_i_ds: free.iter().map(|f| f.id.clone()).collect(),
                    must_include_device_i_ds: must.clone(),
                    allocation_size: count as i32,
                }],
            };
            match call(resource, "GetPreferredAllocation", timeout, client.get_preferred_allocation(ask)).await {
                Ok(answer) => answer.container_responses.into_iter().next().map(|c| c.device_i_ds).unwrap_or_default(),
                Err(error) => {
                    tracing::warn!(resource, %error, "preferred allocation unavailable; choosing without it");
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        // Choose and reserve against the state as it is now: other
        // allocations may have run while the plugin was asked.
        let ids = {
            let mut allocations = self.allocations();
            let (taken, _) = allocations.taken_and_reusable(resource, &request.pod_uid);
            let free: Vec<Free> = free.into_iter().filter(|f| !taken.contains(&f.id)).collect();
            if (free.len() as u64) < count {
                return Err(AllocateError::Unavailable {
                    resource: resource.to_owned(),
                    requested: count,
                    available: free.len(),
                });
            }
            let ids = choose(&free, &must, &preferred, count as usize);
            allocations.reserved.entry(resource.to_owned()).or_default().extend(ids.iter().cloned());
            ids
        };
        match self.call_plugin(resource, &mut client, options, &ids).await {
            Ok(run_options) => Ok(Some(Step::New(Held { device_ids: ids, options: run_options }))),
            Err(error) => {
                self.release(resource, &ids);
                Err(error)
            }
        }
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
        let response = call(resource, "Allocate", timeout, client.allocate(request)).await.map_err(to_error)?;
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
