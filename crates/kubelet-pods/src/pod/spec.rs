//! What the lifecycle reads from a Pod: its identity, containers in start
//! order with their kind, restart policy, resource requests, grace period.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod};

use super::quantity::{QuantityError, parse_milli, parse_units};
use crate::device_manager::{ContainerKind, is_extended_resource_name};

/// Upstream's default `terminationGracePeriodSeconds`.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);

/// A pod's restart policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartPolicy {
    /// Restart every container that ends.
    Always,
    /// Restart containers that fail.
    OnFailure,
    /// Never restart.
    Never,
}

impl RestartPolicy {
    /// The policy of `pod` (`Always` when unset, as the API defaults it).
    pub(crate) fn of(pod: &Pod) -> RestartPolicy {
        match pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) {
            Some("Never") => RestartPolicy::Never,
            Some("OnFailure") => RestartPolicy::OnFailure,
            _ => RestartPolicy::Always,
        }
    }

    /// Whether a container that ended with `exit_code` is restarted.
    pub(crate) fn restarts(self, exit_code: i32) -> bool {
        match self {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => exit_code != 0,
            RestartPolicy::Never => false,
        }
    }
}

/// A pod's identity.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodIdentity {
    /// UID.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl PodIdentity {
    /// Reads the identity of `pod` (empty strings where unset).
    pub(crate) fn of(pod: &Pod) -> PodIdentity {
        PodIdentity {
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            namespace: pod.metadata.namespace.clone().unwrap_or_else(|| "default".to_owned()),
            name: pod.metadata.name.clone().unwrap_or_default(),
        }
    }

    /// `namespace/name`.
    pub(crate) fn full_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The pod's containers in the order they start: init containers (plain and
/// restartable), then app containers.
pub(crate) fn containers(pod: &Pod) -> Vec<(ContainerKind, &Container)> {
    let Some(spec) = pod.spec.as_ref() else { return Vec::new() };
    let init = spec.init_containers.iter().flatten().map(|c| {
        let kind = if c.restart_policy.as_deref() == Some("Always") {
            ContainerKind::RestartableInit
        } else {
            ContainerKind::Init
        };
        (kind, c)
    });
    init.chain(spec.containers.iter().map(|c| (ContainerKind::App, c))).collect()
}

/// Whether `container` runs privileged (`securityContext.privileged`).
pub(crate) fn privileged(container: &Container) -> bool {
    container.security_context.as_ref().and_then(|s| s.privileged).unwrap_or(false)
}

/// The pod's termination grace period: the deletion's, else the spec's
/// `terminationGracePeriodSeconds`, else upstream's default.
pub(crate) fn grace_period(pod: &Pod) -> Duration {
    deletion_grace_period(pod).unwrap_or_else(|| {
        pod.spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds)
            .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0)))
            .unwrap_or(DEFAULT_GRACE_PERIOD)
    })
}

/// The grace period the deletion asked for (`metadata.deletionGracePeriodSeconds`:
/// `kubectl delete --grace-period`, 0 with `--force`), if any.
pub(crate) fn deletion_grace_period(pod: &Pod) -> Option<Duration> {
    pod.metadata.deletion_grace_period_seconds.map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0)))
}

/// CPU (millicores) and memory (bytes) a pod requests, computed as the
/// scheduler does: the larger of what its long-running containers need
/// together (app containers and sidecars) and what any init container needs
/// with the sidecars started before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PodRequests {
    /// Millicores.
    pub cpu_milli: u128,
    /// Bytes.
    pub memory: u128,
}

/// One container's `resources.requests` (falling back to limits, as the API
/// server defaults them) for cpu and memory.
fn container_requests(container: &Container) -> Result<PodRequests, QuantityError> {
    let resources = container.resources.as_ref();
    let get = |name: &str| {
        resources
            .and_then(|r| r.requests.as_ref().and_then(|q| q.get(name)).or(r.limits.as_ref().and_then(|q| q.get(name))))
            .map(|q| q.0.clone())
    };
    Ok(PodRequests {
        cpu_milli: get("cpu").map(|q| parse_milli(&q)).transpose()?.unwrap_or(0),
        memory: get("memory").map(|q| parse_units(&q)).transpose()?.unwrap_or(0),
    })
}

/// The pod's effective cpu and memory requests.
pub(crate) fn pod_requests(pod: &Pod) -> Result<PodRequests, QuantityError> {
    let mut long_running = PodRequests::default();
    let mut init_peak = PodRequests::default();
    for (kind, container) in containers(pod) {
        let requests = container_requests(container)?;
        match kind {
            ContainerKind::Init => {
                init_peak.cpu_milli = init_peak.cpu_milli.max(long_running.cpu_milli + requests.cpu_milli);
                init_peak.memory = init_peak.memory.max(long_running.memory + requests.memory);
            }
            ContainerKind::RestartableInit | ContainerKind::App => {
                long_running.cpu_milli += requests.cpu_milli;
                long_running.memory += requests.memory;
            }
            // (Ephemeral containers have no resources; `containers` never
            // lists them.)
            ContainerKind::Ephemeral => {}
        }
    }
    Ok(PodRequests {
        cpu_milli: long_running.cpu_milli.max(init_peak.cpu_milli),
        memory: long_running.memory.max(init_peak.memory),
    })
}

/// A container's extended-resource limits (what it asks device plugins for).
pub(crate) fn extended_limits(container: &Container) -> Result<BTreeMap<String, u64>, QuantityError> {
    let mut limits = BTreeMap::new();
    let resources = container.resources.as_ref();
    // Extended resources must have requests == limits; either may be given.
    for map in
        [resources.and_then(|r| r.limits.as_ref()), resources.and_then(|r| r.requests.as_ref())].into_iter().flatten()
    {
        for (name, quantity) in map {
            if is_extended_resource_name(name) && !limits.contains_key(name) {
                let count = parse_units(&quantity.0)?;
                limits.insert(name.clone(), u64::try_from(count).map_err(|_| QuantityError(quantity.0.clone()))?);
            }
        }
    }
    Ok(limits)
}
