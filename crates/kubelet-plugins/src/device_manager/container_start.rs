//! What a container gets each time it starts: `PreStartContainer` for each
//! of its resources whose plugin asks for it, then its merged run options.
//!
//! Upstream calls `PreStartContainer` when it gathers a container's run
//! options, that is at every start of the container (restarts included),
//! for each of its device-plugin resources whose plugin set
//! `pre_start_required`; `Allocate` never calls it. So does this module,
//! with upstream's 30 s deadline.
//!
//! # Caveats
//! - A resource whose plugin asked for `PreStartContainer` but is not
//!   connected now (it went away, or was removed after its grace period)
//!   fails the start: the container would run with devices its plugin has
//!   not prepared. Upstream fails the same way.
//! - A resource restored from the checkpoint whose plugin has not come back
//!   yet has unknown options: no call is made (upstream's restored
//!   endpoints have no options either).

use std::time::Duration;

use kubelet_api::deviceplugin::v1beta1::PreStartContainerRequest;
use kubelet_api::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;

use super::DeviceManager;
use super::endpoint::{CallFailure, call};
use super::run_options::RunOptions;

/// `PreStartContainer`'s deadline (upstream's).
const PRE_START_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a container's devices are not ready for it to start.
#[derive(Debug, thiserror::Error)]
pub enum ContainerStartError {
    /// `PreStartContainer` failed.
    #[error("PreStartContainer failed for resource {resource} (pod {pod_uid} container {container}): {status}")]
    Rpc {
        /// Resource.
        resource: String,
        /// The pod's UID.
        pod_uid: String,
        /// The container.
        container: String,
        /// The gRPC status.
        #[source]
        status: tonic::Status,
    },
    /// `PreStartContainer` did not answer in time.
    #[error(
        "PreStartContainer for resource {resource} (pod {pod_uid} container {container}) did not answer within {timeout:?}"
    )]
    Timeout {
        /// Resource.
        resource: String,
        /// The pod's UID.
        pod_uid: String,
        /// The container.
        container: String,
        /// The deadline.
        timeout: Duration,
    },
    /// The resource's plugin asked for `PreStartContainer` but is not
    /// connected.
    #[error(
        "the device plugin for resource {resource} requires PreStartContainer but is not connected (pod {pod_uid} container {container})"
    )]
    PluginGone {
        /// Resource.
        resource: String,
        /// The pod's UID.
        pod_uid: String,
        /// The container.
        container: String,
    },
}

/// One `PreStartContainer` to make.
struct PreStart {
    resource: String,
    device_ids: Vec<String>,
    client: DevicePluginClient<kubelet_api::uds::UdsChannel>,
    calls: std::sync::Arc<tokio::sync::Semaphore>,
}

/// What a start needs, taken under the locks.
#[derive(Default)]
struct StartPlan {
    pre_starts: Vec<PreStart>,
    /// Each resource's run options, in resource-name order.
    parts: Vec<(String, RunOptions)>,
}

impl DeviceManager {
    /// Prepares the container's devices for a start of the container and
    /// returns its run options (merged across resources, in resource-name
    /// order). Call it before every start, restarts included: it calls
    /// `PreStartContainer` (with a deadline) for each resource whose plugin
    /// asked for it. A container without devices gets empty options.
    pub async fn container_run_options(
        &self,
        pod_uid: &str,
        container: &str,
    ) -> Result<RunOptions, ContainerStartError> {
        let StartPlan { pre_starts, parts } = self.plan_start(pod_uid, container)?;
        for PreStart { resource, device_ids, mut client, calls } in pre_starts {
            // Fails only if the semaphore is closed, which never happens.
            let _permit = calls.acquire_owned().await.ok();
            tracing::debug!(pod.uid = pod_uid, container, %resource, devices = ?device_ids, "PreStartContainer");
            let request = PreStartContainerRequest { devices_ids: device_ids };
            call(PRE_START_TIMEOUT, client.pre_start_container(request)).await.map_err(|failure| {
                let (pod_uid, container) = (pod_uid.to_owned(), container.to_owned());
                match failure {
                    CallFailure::Status(status) => ContainerStartError::Rpc { resource, pod_uid, container, status },
                    CallFailure::Timeout(timeout) => {
                        ContainerStartError::Timeout { resource, pod_uid, container, timeout }
                    }
                }
            })?;
        }
        Ok(RunOptions::merged(parts.iter().map(|(resource, options)| (resource.as_str(), options))))
    }

    /// Under the locks: the calls to make and each resource's run options.
    fn plan_start(&self, pod_uid: &str, container: &str) -> Result<StartPlan, ContainerStartError> {
        let resources = self.lock();
        let allocations = self.allocations();
        let Some(record) = allocations.container(pod_uid, container) else { return Ok(StartPlan::default()) };
        let mut plan = StartPlan::default();
        for (resource, held) in &record.resources {
            plan.parts.push((resource.clone(), held.options.clone()));
            let entry = resources.get(resource);
            if !entry.and_then(|r| r.options).is_some_and(|o| o.pre_start_required) {
                continue;
            }
            let Some(endpoint) = entry.and_then(|r| r.endpoint.as_ref()) else {
                return Err(ContainerStartError::PluginGone {
                    resource: resource.clone(),
                    pod_uid: pod_uid.to_owned(),
                    container: container.to_owned(),
                });
            };
            plan.pre_starts.push(PreStart {
                resource: resource.clone(),
                device_ids: held.device_ids.clone(),
                client: DevicePluginClient::new(endpoint.channel.clone()),
                calls: endpoint.calls.clone(),
            });
        }
        Ok(plan)
    }
}
