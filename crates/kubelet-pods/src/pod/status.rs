//! The pod status as the kubelet computes it: phase, conditions, container
//! statuses. This is the value cluster mode patches to the API server.

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, HostIP,
    PodCondition, PodIP, PodStatus, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::data::{ContainerPhase, ContainerRecord, PodData, Terminated};
use crate::device_manager::ContainerKind;

/// Where the pod's lifecycle is, as its current state tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Before its containers start.
    Pending,
    /// Containers started (some may be restarting).
    Running,
    /// Every container is done (the phase follows from how they ended).
    Done,
    /// Being removed.
    Terminating,
}

/// Fills `hostIP(s)` and `podIP(s)` with the node's IPs (pods run in the
/// node's network), unless the status names its own.
pub(crate) fn add_ips(status: &mut PodStatus, ips: &[std::net::IpAddr]) {
    let Some(first) = ips.first() else { return };
    if status.host_ip.is_none() {
        status.host_ip = Some(first.to_string());
        status.host_ips = Some(ips.iter().map(|ip| HostIP { ip: ip.to_string() }).collect());
    }
    if status.pod_ip.is_none() {
        status.pod_ip = Some(first.to_string());
        status.pod_ips = Some(ips.iter().map(|ip| PodIP { ip: ip.to_string() }).collect());
    }
}

/// Computes the pod's status from its data.
pub(crate) fn pod_status(data: &PodData, stage: Stage) -> PodStatus {
    if let Some(verdict) = data.verdict.as_ref().filter(|v| v.rejected) {
        return PodStatus {
            phase: Some(verdict.phase.to_owned()),
            reason: verdict.reason.clone(),
            message: verdict.message.clone(),
            start_time: Some(Time(data.start_time)),
            qos_class: Some(kubelet_provider::qos::qos_class(&data.pod).as_str().to_owned()),
            ..PodStatus::default()
        };
    }
    let init: Vec<&ContainerRecord> =
        data.ordered().filter(|c| matches!(c.kind, ContainerKind::Init | ContainerKind::RestartableInit)).collect();
    let apps: Vec<&ContainerRecord> = data.ordered().filter(|c| c.kind == ContainerKind::App).collect();
    let ephemeral: Vec<&ContainerRecord> = data.ordered().filter(|c| c.kind == ContainerKind::Ephemeral).collect();
    let phase = phase(data, stage, &apps);
    let conditions = conditions(data, stage, &init, &phase);
    let has_init_containers = !init.is_empty();
    let mut status = PodStatus {
        phase: Some(phase),
        reason: data.verdict.as_ref().and_then(|v| v.reason.clone()),
        message: data.verdict.as_ref().and_then(|v| v.message.clone()).or_else(|| data.pending_message.clone()),
        conditions: Some(conditions),
        init_container_statuses: (!init.is_empty())
            .then(|| init.iter().map(|c| container_status(c, has_init_containers)).collect()),
        container_statuses: Some(apps.iter().map(|c| container_status(c, has_init_containers)).collect()),
        ephemeral_container_statuses: (!ephemeral.is_empty())
            .then(|| ephemeral.iter().map(|c| container_status(c, false)).collect()),
        start_time: Some(Time(data.start_time)),
        qos_class: Some(kubelet_provider::qos::qos_class(&data.pod).as_str().to_owned()),
        // The pod's own network, if its provider gave it one; else the
        // node's IPs are filled in later.
        pod_ip: data.pod_ips.first().map(ToString::to_string),
        pod_ips: (!data.pod_ips.is_empty())
            .then(|| data.pod_ips.iter().map(|ip| PodIP { ip: ip.to_string() }).collect()),
        ..PodStatus::default()
    };
    limit_termination_messages(&mut status, init.len() + apps.len());
    status
}

/// The pod's phase at `stage`, its app containers being `apps`.
fn phase(data: &PodData, stage: Stage, apps: &[&ContainerRecord]) -> String {
    // A pod the API showed started before a node restart: its containers
    // ran, so it is Running while the node takes it on again (its phase
    // never goes back to Pending).
    let ran_before = apps.iter().any(|c| c.previous_run.as_ref().is_some_and(|p| p.started));
    // Upstream: a container that has never run (waiting, no last
    // termination) keeps the pod Pending.
    let never_ran =
        |c: &&ContainerRecord| matches!(c.phase, ContainerPhase::Waiting { .. }) && c.last_terminated.is_none();
    let phase = match (&data.verdict, stage) {
        (Some(verdict), _) => verdict.phase,
        (None, Stage::Pending) if ran_before => "Running",
        (None, Stage::Pending) => "Pending",
        (None, Stage::Running | Stage::Terminating) if !ran_before && apps.iter().any(never_ran) => "Pending",
        (None, Stage::Running | Stage::Terminating) => "Running",
        (None, Stage::Done) if apps.iter().all(|c| c.succeeded()) => "Succeeded",
        (None, Stage::Done) => "Failed",
    };
    phase.to_owned()
}

/// The pod's conditions at `stage` in `phase`, its init containers (and
/// sidecars) being `init`.
fn conditions(data: &PodData, stage: Stage, init: &[&ContainerRecord], phase: &str) -> Vec<PodCondition> {
    let now = Timestamp::now();
    let unready: Vec<&str> =
        data.ordered().filter(|c| c.counts_for_readiness() && !c.is_ready()).map(|c| c.spec.name.as_str()).collect();
    let uninitialized: Vec<&str> = init
        .iter()
        .filter(|c| match c.kind {
            ContainerKind::Init => !data.initialized && !c.succeeded(),
            _ => !c.is_running() && !data.initialized,
        })
        .map(|c| c.spec.name.as_str())
        .collect();
    let succeeded_pod = phase == "Succeeded";
    let mut conditions = vec![condition("PodScheduled", true, None, None, now)];
    conditions.push(condition("PodReadyToStartContainers", data.volumes_ready, None, None, now));
    conditions.push(if data.initialized || succeeded_pod {
        condition("Initialized", true, None, None, now)
    } else {
        condition(
            "Initialized",
            false,
            Some("ContainersNotInitialized"),
            Some(format!("containers with incomplete status: [{}]", uninitialized.join(" "))),
            now,
        )
    });
    let ready = unready.is_empty() && stage == Stage::Running && data.verdict.is_none();
    for kind in ["ContainersReady", "Ready"] {
        conditions.push(if ready {
            condition(kind, true, None, None, now)
        } else if succeeded_pod || phase == "Failed" {
            condition(kind, false, Some("PodCompleted"), None, now)
        } else {
            condition(
                kind,
                false,
                Some("ContainersNotReady"),
                Some(format!("containers with unready status: [{}]", unready.join(" "))),
                now,
            )
        });
    }
    if let Some((reason, message)) = &data.resize.pending {
        conditions.push(condition("PodResizePending", true, Some(reason), Some(message.clone()), now));
    }
    if stage == Stage::Running && super::resize::in_progress(data) {
        let error = data.resize.error.clone();
        conditions.push(condition("PodResizeInProgress", true, error.as_ref().map(|_| "Error"), error, now));
    }
    if data.verdict.as_ref().is_some_and(|v| v.disruption) {
        // Upstream (PodDisruptionConditions, on by default in 1.28), for an
        // eviction for the node's pressure.
        let message = data.verdict.as_ref().and_then(|v| v.message.clone());
        conditions.push(condition("DisruptionTarget", true, Some("TerminationByKubelet"), message, now));
    }
    conditions
}

/// The most termination-message bytes a pod's statuses carry, shared
/// evenly by its containers (upstream's 12 KiB).
pub(crate) const MAX_POD_TERMINATION_MESSAGES: usize = 12 * 1024;

/// Cuts each terminated state's message to the pod's share per container
/// (its first bytes), as upstream's status manager does.
fn limit_termination_messages(status: &mut PodStatus, containers: usize) {
    let share = MAX_POD_TERMINATION_MESSAGES / containers.max(1);
    let statuses = status
        .container_statuses
        .iter_mut()
        .chain(status.init_container_statuses.iter_mut())
        .chain(status.ephemeral_container_statuses.iter_mut())
        .flatten();
    for container in statuses {
        for state in [container.state.as_mut(), container.last_state.as_mut()].into_iter().flatten() {
            if let Some(message) = state.terminated.as_mut().and_then(|t| t.message.as_mut())
                && message.len() > share
            {
                let mut end = share;
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                message.truncate(end);
            }
        }
    }
}

fn condition(kind: &str, status: bool, reason: Option<&str>, message: Option<String>, now: Timestamp) -> PodCondition {
    PodCondition {
        type_: kind.to_owned(),
        status: if status { "True" } else { "False" }.to_owned(),
        reason: reason.map(str::to_owned),
        message,
        last_transition_time: Some(Time(now)),
        ..PodCondition::default()
    }
}

/// A container ID as the status shows it: `<runtime>://<id>`, as upstream
/// (an ID that has a scheme already, from the API after a node restart,
/// is kept).
fn shown_id(runtime: &str, id: &crate::provider::ContainerId) -> String {
    if runtime.is_empty() || id.0.contains("://") { id.0.clone() } else { format!("{runtime}://{}", id.0) }
}

fn terminated_state(t: &Terminated, runtime: &str) -> ContainerState {
    ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code: t.exit_code,
            reason: Some(t.reason.clone()),
            message: t.message.clone(),
            started_at: t.started_at.map(Time),
            finished_at: Some(Time(t.finished_at)),
            container_id: t.container_id.as_ref().map(|id| shown_id(runtime, id)),
            ..ContainerStateTerminated::default()
        }),
        ..ContainerState::default()
    }
}

/// A container's status. As upstream: in a pod with init containers, a
/// container that waits for nothing but its turn says `PodInitializing`
/// (not `ContainerCreating`); an init container that completed is ready.
fn container_status(c: &ContainerRecord, has_init_containers: bool) -> ContainerStatus {
    let state = match &c.phase {
        ContainerPhase::Waiting { reason, message } => {
            let reason = if has_init_containers && reason == "ContainerCreating" && message.is_none() {
                "PodInitializing".to_owned()
            } else {
                reason.clone()
            };
            ContainerState {
                waiting: Some(ContainerStateWaiting { reason: Some(reason), message: message.clone() }),
                ..ContainerState::default()
            }
        }
        ContainerPhase::Running { started_at } => ContainerState {
            running: Some(ContainerStateRunning { started_at: Some(Time(*started_at)) }),
            ..ContainerState::default()
        },
        ContainerPhase::Terminated(t) => terminated_state(t, &c.runtime),
    };
    ContainerStatus {
        name: c.spec.name.clone(),
        image: c.spec.image.clone().unwrap_or_default(),
        image_id: c.image_id.clone().unwrap_or_default(),
        container_id: c.id.as_ref().map(|id| shown_id(&c.runtime, id)),
        ready: match c.kind {
            ContainerKind::Init => c.succeeded(),
            ContainerKind::Ephemeral => false,
            _ => c.is_ready(),
        },
        started: Some(c.has_started()),
        restart_count: i32::try_from(c.restart_count).unwrap_or(i32::MAX),
        state: Some(state),
        last_state: c.last_terminated.as_ref().map(|t| terminated_state(t, &c.runtime)),
        // As upstream with in-place resize on: what a running container
        // has now, else what is allocated to it; and its allocated requests.
        resources: (c.kind != ContainerKind::Ephemeral).then(|| {
            let allocated = c.spec.resources.clone().unwrap_or_default();
            match &c.actuated {
                Some(actuated) if c.is_running() => {
                    ResourceRequirements { claims: allocated.claims, ..actuated.clone() }
                }
                _ => allocated,
            }
        }),
        allocated_resources: c
            .spec
            .resources
            .as_ref()
            .and_then(|r| r.requests.clone())
            .filter(|r| !r.is_empty() && c.kind != ContainerKind::Ephemeral),
        ..ContainerStatus::default()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, ContainerStatus};

    use super::*;

    #[test]
    fn termination_messages_share_twelve_kib_across_the_containers() {
        let terminated = |message: &str| ContainerState {
            terminated: Some(ContainerStateTerminated { message: Some(message.to_owned()), ..Default::default() }),
            ..Default::default()
        };
        let long = "é".repeat(4000);
        let mut status = PodStatus {
            container_statuses: Some(vec![
                ContainerStatus {
                    state: Some(terminated(&long)),
                    last_state: Some(terminated(&long)),
                    ..Default::default()
                };
                4
            ]),
            ..Default::default()
        };
        limit_termination_messages(&mut status, 4);
        for container in status.container_statuses.iter().flatten() {
            let message = container.state.as_ref().and_then(|s| s.terminated.as_ref()).and_then(|t| t.message.clone());
            // 3072 bytes each, cut on a character boundary.
            assert_eq!(message.map(|m| m.len()), Some(3072));
        }
    }
}
