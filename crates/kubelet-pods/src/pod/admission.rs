//! Admission: whether the node takes a pod, checked in upstream's order —
//! pod count, then cpu and memory requests against allocatable, then
//! extended resources against what device plugins advertise. Device
//! allocation itself follows in the Resources state.

use std::collections::BTreeMap;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::Pod;

use super::spec::{PodRequests, containers, extended_limits, pod_requests};
use crate::device_manager::Capacities;

/// What the node offers pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocatable {
    /// Millicores.
    pub cpu_milli: u128,
    /// Bytes.
    pub memory: u128,
    /// Pods at most (`--max-pods`).
    pub pods: usize,
}

/// Why a pod was turned away (upstream's reasons and texts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// `OutOfpods`, `OutOfcpu`, `OutOfmemory`, `OutOf<resource>`,
    /// `UnexpectedAdmissionError`, `InvalidPod`.
    pub reason: String,
    /// What to tell the user (without the `Pod was rejected: ` prefix).
    pub message: String,
}

impl Rejection {
    fn out_of(resource: &str, requested: u128, used: u128, capacity: u128) -> Rejection {
        Rejection {
            reason: format!("OutOf{resource}"),
            message: format!(
                "Node didn't have enough resource: {resource}, requested: {requested}, used: {used}, capacity: {capacity}"
            ),
        }
    }
}

/// The pods the node has admitted, with their requests.
#[derive(Debug)]
pub(crate) struct AdmittedPods {
    pods: Mutex<Admitted>,
    /// Bumped whenever requests are given back (a pod leaves, a resize
    /// shrinks one): deferred resizes are judged again.
    released: tokio::sync::watch::Sender<u64>,
}

impl Default for AdmittedPods {
    fn default() -> Self {
        AdmittedPods { pods: Mutex::default(), released: tokio::sync::watch::channel(0).0 }
    }
}

/// The admitted pods and the sums of their requests (kept as pods come and
/// go, so that admitting one costs the same with 50,000 admitted as with 1).
#[derive(Debug, Default)]
struct Admitted {
    requests: BTreeMap<String, PodRequests>,
    cpu_milli: u128,
    memory: u128,
}

impl AdmittedPods {
    /// Checks `pod` against what is left and, if it fits, counts it in.
    ///
    /// `held(container, resource)` is how many devices of `resource` the
    /// container already holds (from the checkpoint, after a node restart):
    /// those need no free device, so a pod the node ran before it restarted
    /// is admitted again before its device plugin has registered again.
    pub(crate) fn admit(
        &self,
        uid: &str,
        pod: &Pod,
        allocatable: Allocatable,
        devices: &Capacities,
        held: impl Fn(&str, &str) -> usize,
        overhead: u128,
    ) -> Result<(), Rejection> {
        let mut requests = pod_requests(pod)
            .map_err(|e| Rejection { reason: "InvalidPod".into(), message: format!("resource requests: {e}") })?;
        requests.memory = requests.memory.checked_add(overhead).ok_or_else(|| Rejection {
            reason: "InvalidPod".into(),
            message: format!("resource requests: memory {} is out of range", requests.memory),
        })?;
        let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
        if pods.requests.contains_key(uid) {
            return Ok(());
        }
        if pods.requests.len() >= allocatable.pods {
            return Err(Rejection::out_of("pods", 1, pods.requests.len() as u128, allocatable.pods as u128));
        }
        let used_cpu = pods.cpu_milli;
        if requests.cpu_milli > 0 && used_cpu.saturating_add(requests.cpu_milli) > allocatable.cpu_milli {
            return Err(Rejection::out_of("cpu", requests.cpu_milli, used_cpu, allocatable.cpu_milli));
        }
        let used_memory = pods.memory;
        if requests.memory > 0 && used_memory.saturating_add(requests.memory) > allocatable.memory {
            return Err(Rejection::out_of("memory", requests.memory, used_memory, allocatable.memory));
        }
        for container in containers(pod).into_iter().map(|(_, c)| c) {
            let limits = extended_limits(container)
                .map_err(|e| Rejection { reason: "InvalidPod".into(), message: format!("resource limits: {e}") })?;
            for (resource, count) in limits {
                let allocatable = devices.get(&resource).map(|c| c.allocatable).unwrap_or(0);
                if count > 0 && allocatable == 0 && held(&container.name, &resource) < count as usize {
                    return Err(Rejection::out_of(&resource, count.into(), 0, 0));
                }
            }
        }
        pods.cpu_milli += requests.cpu_milli;
        pods.memory += requests.memory;
        pods.requests.insert(uid.to_owned(), requests);
        Ok(())
    }

    /// Counts the pod out.
    pub(crate) fn release(&self, uid: &str) {
        let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(requests) = pods.requests.remove(uid) {
            pods.cpu_milli -= requests.cpu_milli;
            pods.memory -= requests.memory;
            drop(pods);
            self.released.send_modify(|n| *n += 1);
        }
    }

    /// Counts admitted pod `uid` at `pod`'s (resized) requests instead of
    /// its current ones, if they fit beside the other pods (upstream judges
    /// a resize as the admission of the resized pod among the others).
    pub(crate) fn resize(
        &self,
        uid: &str,
        pod: &Pod,
        allocatable: Allocatable,
        overhead: u128,
    ) -> Result<(), Rejection> {
        let mut requests = pod_requests(pod)
            .map_err(|e| Rejection { reason: "InvalidPod".into(), message: format!("resource requests: {e}") })?;
        requests.memory = requests.memory.saturating_add(overhead);
        let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
        let before = pods.requests.get(uid).copied().unwrap_or_default();
        let used_cpu = pods.cpu_milli - before.cpu_milli;
        if requests.cpu_milli > before.cpu_milli && used_cpu.saturating_add(requests.cpu_milli) > allocatable.cpu_milli
        {
            return Err(Rejection::out_of("cpu", requests.cpu_milli, used_cpu, allocatable.cpu_milli));
        }
        let used_memory = pods.memory - before.memory;
        if requests.memory > before.memory && used_memory.saturating_add(requests.memory) > allocatable.memory {
            return Err(Rejection::out_of("memory", requests.memory, used_memory, allocatable.memory));
        }
        pods.cpu_milli = used_cpu + requests.cpu_milli;
        pods.memory = used_memory + requests.memory;
        pods.requests.insert(uid.to_owned(), requests);
        drop(pods);
        if requests.cpu_milli < before.cpu_milli || requests.memory < before.memory {
            self.released.send_modify(|n| *n += 1);
        }
        Ok(())
    }

    /// Changes whenever requests are given back.
    pub(crate) fn releases(&self) -> tokio::sync::watch::Receiver<u64> {
        self.released.subscribe()
    }
}
