//! The PodResources API: `v1.PodResourcesLister` on
//! `<root-dir>/pod-resources/kubelet.sock`, which monitoring agents (GPU
//! exporters, topology updaters) read to learn what each container was
//! given.
//!
//! - `List`: every pod the node runs (not the finished ones), containers in
//!   the kubelet's order (sidecar init containers first, then the
//!   containers), each with its device-plugin devices (grouped per resource
//!   and NUMA node, with the topology the plugin reported) and the devices
//!   of the resource claims it uses (claim, driver, pool, device, CDI IDs).
//! - `Get`: one pod by name and namespace; an unknown pod is upstream's
//!   `pod <name> in namespace <namespace> not found`.
//! - `GetAllocatableResources`: every healthy device-plugin device.
//! - CPU IDs and memory are always empty: the node has no CPU or memory
//!   manager (no exclusive CPUs, no NUMA memory pinning).
//! - Every call passes a token bucket (upstream: 100 per second, burst 10);
//!   beyond it the answer is `ResourceExhausted` "rejected by rate limit".

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kubelet_api::podresources::v1 as api;
use kubelet_api::podresources::v1::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::device_manager::{Device, DeviceManager};
use crate::dra::DraClaims;
use crate::pod::Pods;

/// Settings of the PodResources API.
#[derive(Clone, Debug)]
pub struct PodResourcesConfig {
    /// The socket (`<root-dir>/pod-resources/kubelet.sock`).
    pub socket: PathBuf,
    /// Calls per second allowed on average (upstream: 100).
    pub qps: f64,
    /// Calls allowed at once beyond the average (upstream: 10).
    pub burst: u32,
}

impl PodResourcesConfig {
    /// Upstream's socket and rate limit under `root_dir`.
    pub fn new(root_dir: &std::path::Path) -> Self {
        PodResourcesConfig {
            socket: root_dir
                .join(kubelet_api::constants::POD_RESOURCES_DIR)
                .join(kubelet_api::constants::KUBELET_SOCKET),
            qps: 100.0,
            burst: 10,
        }
    }
}

/// A token bucket: `burst` tokens, refilled at `qps` per second.
struct RateLimit {
    qps: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl RateLimit {
    fn new(qps: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        RateLimit { qps, burst, state: Mutex::new((burst, Instant::now())) }
    }

    fn allow(&self) -> bool {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (tokens, last) = *state;
        let now = now.max(last);
        let refilled = (tokens + now.duration_since(last).as_secs_f64() * self.qps).min(self.burst);
        if refilled >= 1.0 {
            *state = (refilled - 1.0, now);
            true
        } else {
            *state = (refilled, now);
            false
        }
    }
}

#[derive(Clone)]
struct Lister {
    pods: Pods,
    devices: DeviceManager,
    claims: Option<DraClaims>,
    limit: Arc<RateLimit>,
}

impl Lister {
    fn admit(&self) -> Result<(), Status> {
        if self.limit.allow() { Ok(()) } else { Err(Status::resource_exhausted("rejected by rate limit")) }
    }

    fn active_pods(&self) -> Vec<Pod> {
        self.pods
            .store()
            .list()
            .into_iter()
            .filter(|p| {
                let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                !matches!(phase, Some("Succeeded" | "Failed"))
            })
            .collect()
    }

    fn pod_resources(&self, pod: &Pod) -> api::PodResources {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let mut devices = self.devices.pod_devices(&uid);
        let spec = pod.spec.as_ref();
        let sidecars = spec
            .and_then(|s| s.init_containers.as_ref())
            .into_iter()
            .flatten()
            .filter(|c| c.restart_policy.as_deref() == Some("Always"));
        let containers = spec.map(|s| s.containers.iter()).into_iter().flatten();
        let containers = sidecars
            .chain(containers)
            .map(|container| api::ContainerResources {
                name: container.name.clone(),
                devices: devices.remove(&container.name).map(container_devices).unwrap_or_default(),
                cpu_ids: Vec::new(),
                memory: Vec::new(),
                dynamic_resources: self
                    .claims
                    .as_ref()
                    .map(|claims| dynamic_resources(claims, pod, &container.name))
                    .unwrap_or_default(),
            })
            .collect();
        api::PodResources {
            name: pod.metadata.name.clone().unwrap_or_default(),
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            containers,
        }
    }
}

fn topology(numa_nodes: &[i64]) -> Option<api::TopologyInfo> {
    (!numa_nodes.is_empty())
        .then(|| api::TopologyInfo { nodes: numa_nodes.iter().map(|id| api::NumaNode { id: *id }).collect() })
}

/// One entry per resource and NUMA placement, as upstream groups them.
fn container_devices(held: BTreeMap<String, Vec<Device>>) -> Vec<api::ContainerDevices> {
    let mut out = Vec::new();
    for (resource, devices) in held {
        let mut by_numa: BTreeMap<Vec<i64>, Vec<String>> = BTreeMap::new();
        for device in devices {
            by_numa.entry(device.numa_nodes).or_default().push(device.id);
        }
        for (numa, device_ids) in by_numa {
            out.push(api::ContainerDevices { resource_name: resource.clone(), device_ids, topology: topology(&numa) });
        }
    }
    out
}

fn dynamic_resources(claims: &DraClaims, pod: &Pod, container: &str) -> Vec<api::DynamicResource> {
    claims
        .container_claims(pod, container)
        .into_iter()
        .map(|claim| api::DynamicResource {
            claim_name: claim.name,
            claim_namespace: claim.namespace,
            claim_resources: claim
                .devices
                .into_iter()
                .map(|(driver, device)| api::ClaimResource {
                    cdi_devices: device.cdi_device_ids.into_iter().map(|name| api::CdiDevice { name }).collect(),
                    driver_name: driver,
                    pool_name: device.pool,
                    device_name: device.device,
                })
                .collect(),
        })
        .collect()
}

#[tonic::async_trait]
impl PodResourcesLister for Lister {
    async fn list(
        &self,
        _: Request<api::ListPodResourcesRequest>,
    ) -> Result<Response<api::ListPodResourcesResponse>, Status> {
        self.admit()?;
        let pod_resources = self.active_pods().iter().map(|p| self.pod_resources(p)).collect();
        Ok(Response::new(api::ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<api::AllocatableResourcesRequest>,
    ) -> Result<Response<api::AllocatableResourcesResponse>, Status> {
        self.admit()?;
        let devices = self
            .devices
            .allocatable_devices()
            .into_iter()
            .map(|(resource, device)| api::ContainerDevices {
                resource_name: resource,
                topology: topology(&device.numa_nodes),
                device_ids: vec![device.id],
            })
            .collect();
        Ok(Response::new(api::AllocatableResourcesResponse { devices, cpu_ids: Vec::new(), memory: Vec::new() }))
    }

    async fn get(
        &self,
        request: Request<api::GetPodResourcesRequest>,
    ) -> Result<Response<api::GetPodResourcesResponse>, Status> {
        self.admit()?;
        let request = request.into_inner();
        let pod = self.active_pods().into_iter().find(|p| {
            p.metadata.name.as_deref() == Some(request.pod_name.as_str())
                && p.metadata.namespace.as_deref() == Some(request.pod_namespace.as_str())
        });
        match pod {
            Some(pod) => {
                Ok(Response::new(api::GetPodResourcesResponse { pod_resources: Some(self.pod_resources(&pod)) }))
            }
            None => Err(Status::unknown(format!(
                "pod {} in namespace {} not found",
                request.pod_name, request.pod_namespace
            ))),
        }
    }
}

/// Binds the PodResources socket (mode 0600) and serves until `shutdown`.
pub fn serve(
    config: &PodResourcesConfig,
    pods: Pods,
    devices: DeviceManager,
    claims: Option<DraClaims>,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, kubelet_api::uds::UdsError> {
    // Root (and the node's user) only: the answers name every pod's
    // devices, and upstream's socket is root's too.
    let listener = kubelet_api::uds::bind_with_mode(&config.socket, 0o600)?;
    let lister = Lister { pods, devices, claims, limit: Arc::new(RateLimit::new(config.qps, config.burst)) };
    let socket = config.socket.clone();
    tracing::info!(socket = %socket.display(), "PodResources API listening");
    // Not supervised here: returned to the node, which watches it (`pod-resources`).
    Ok(tokio::spawn(async move {
        let router = tonic::transport::Server::builder().add_service(PodResourcesListerServer::new(lister));
        if let Err(error) = kubelet_api::uds::serve(router, listener, shutdown.cancelled_owned()).await {
            tracing::warn!(socket = %socket.display(), %error, "PodResources API stopped");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_bucket_allows_the_burst_then_the_rate() {
        let limit = RateLimit::new(100.0, 10);
        let start = *limit.state.lock().expect("state");
        let at = |ms: u64| start.1 + Duration::from_millis(ms);
        assert_eq!((0..50).filter(|_| limit.allow_at(at(0))).count(), 10, "the burst");
        assert!(!limit.allow_at(at(5)), "half a token after 5 ms");
        assert!(limit.allow_at(at(10)), "one token after 10 ms");
        assert_eq!((0..50).filter(|_| limit.allow_at(at(60))).count(), 5, "100 per second");
        assert_eq!((0..50).filter(|_| limit.allow_at(at(10_000))).count(), 10, "never more than the burst");
    }
}
