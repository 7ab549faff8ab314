//! In-place pod resize, as a 1.33 kubelet does it.
//!
//! The API server writes a new size into the pod's spec (the `resize`
//! subresource). The node compares it with what it has **allocated** to
//! each app and sidecar container (the spec it starts them from, and what
//! the Resources stage counted):
//!
//! - equal: nothing to do; a `PodResizePending` condition goes;
//! - a static pod, or a pod that would need more cpu or memory than the
//!   node has at all: `PodResizePending`, reason `Infeasible`, with
//!   upstream's message; it stays so until the spec changes;
//! - more than is free beside the other pods: `PodResizePending`, reason
//!   `Deferred`, with the admission message; tried again whenever another
//!   pod gives resources back (or the spec changes);
//! - otherwise the new size is **allocated**: counted in admission,
//!   written to `<root>/pods/<uid>/allocated_resources.json` (durably: a
//!   node restart reads it, so a resize it had not allocated is judged
//!   again, and one it had is kept) and then **actuated** under a
//!   `PodResizeInProgress` condition: the pod's limits are raised to the
//!   larger of the old and new sizes, each running container is updated
//!   in place ([`Provider::update_container_resources`]) or, where a
//!   changed resource's `resizePolicy` says `RestartContainer`, stopped and
//!   started again at once with the new size (its restart count goes up),
//!   and the pod's limits are set to the new size.
//!
//! The container statuses' `resources` say what each running container
//! has now (what it was started or last updated with), `allocatedResources`
//! what is allocated to it; a failed update leaves `PodResizeInProgress`
//! with reason `Error` and the provider's message.
//!
//! [`Provider::update_container_resources`]: crate::provider::Provider::update_container_resources

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, Pod, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use krator::Context;

use super::PodLifecycle;
use super::data::{ContainerEvent, PodData};
use super::spec::pod_requests;
use crate::device_manager::ContainerKind;

/// The allocation's file in the pod's directory.
pub(crate) const ALLOCATION_FILE: &str = "allocated_resources.json";

/// `PodResizePending` reasons (upstream's).
pub(crate) const INFEASIBLE: &str = "Infeasible";
pub(crate) const DEFERRED: &str = "Deferred";

/// Allocated resources by container name (app and sidecar containers).
pub(crate) type Allocation = BTreeMap<String, ResourceRequirements>;

/// Where a pod's resize stands, for its status.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ResizeState {
    /// `PodResizePending`: its reason and message.
    pub pending: Option<(String, String)>,
    /// The last actuation failed: `PodResizeInProgress` with reason
    /// `Error` and this message until one succeeds.
    pub error: Option<String>,
    /// A deferred resize waits for another pod to give resources back.
    pub(crate) waiting_release: bool,
}

/// `<root>/pods/<uid>/allocated_resources.json`.
pub(crate) fn checkpoint_path(root: &Path, uid: &str) -> PathBuf {
    root.join("pods").join(uid).join(ALLOCATION_FILE)
}

/// The allocation an earlier run of the node recorded for pod `uid`.
pub(crate) fn read_checkpoint(root: &Path, uid: &str) -> Option<Allocation> {
    let path = checkpoint_path(root, uid);
    let bytes = std::fs::read(&path).ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(allocation) => Some(allocation),
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "unreadable resize allocation; the pod's spec is used");
            None
        }
    }
}

fn write_checkpoint(root: &Path, uid: &str, allocation: &Allocation) -> std::io::Result<()> {
    let path = checkpoint_path(root, uid);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let bytes = serde_json::to_vec(allocation).map_err(std::io::Error::other)?;
    kubelet_support::durable::write(&path, &bytes, 0o600)
}

/// The containers a resize may change: app containers and sidecars
/// (restartable init containers), mutable.
fn resizable_mut(pod: &mut Pod) -> impl Iterator<Item = &mut Container> {
    let spec = pod.spec.as_mut();
    let (apps, init) = match spec {
        Some(spec) => (Some(&mut spec.containers), spec.init_containers.as_mut()),
        None => (None, None),
    };
    apps.into_iter()
        .flatten()
        .chain(init.into_iter().flatten().filter(|c| c.restart_policy.as_deref() == Some("Always")))
}

fn resizable(pod: &Pod) -> impl Iterator<Item = &Container> {
    let spec = pod.spec.as_ref();
    spec.map(|s| s.containers.iter()).into_iter().flatten().chain(
        spec.and_then(|s| s.init_containers.as_ref())
            .into_iter()
            .flatten()
            .filter(|c| c.restart_policy.as_deref() == Some("Always")),
    )
}

/// `pod` with `allocation`'s resources in place of its containers'.
pub(crate) fn with_allocation(pod: &Pod, allocation: &Allocation) -> Pod {
    let mut pod = pod.clone();
    for container in resizable_mut(&mut pod) {
        if let Some(resources) = allocation.get(&container.name) {
            container.resources = Some(resources.clone()).filter(|r| !is_empty(r));
        }
    }
    pod
}

/// What `data` has allocated to its resizable containers.
pub(crate) fn allocation_of(data: &PodData) -> Allocation {
    data.containers
        .values()
        .filter(|c| matches!(c.kind, ContainerKind::App | ContainerKind::RestartableInit))
        .map(|c| (c.spec.name.clone(), c.spec.resources.clone().unwrap_or_default()))
        .collect()
}

/// `pod` (a newer manifest) with what `data` has allocated.
pub(crate) fn allocated_pod(pod: &Pod, data: &PodData) -> Pod {
    with_allocation(pod, &allocation_of(data))
}

/// The resources of `pod`'s resizable containers, by name: what a resize
/// changes.
pub(crate) fn sizes(pod: &Pod) -> Vec<(String, ResourceRequirements)> {
    resizable(pod).map(|c| (c.name.clone(), c.resources.clone().unwrap_or_default())).collect()
}

fn is_empty(resources: &ResourceRequirements) -> bool {
    resources.limits.as_ref().is_none_or(BTreeMap::is_empty)
        && resources.requests.as_ref().is_none_or(BTreeMap::is_empty)
        && resources.claims.as_ref().is_none_or(Vec::is_empty)
}

/// A quantity's value for comparison (`1000m` is `1`); the text itself if
/// it does not parse.
fn value(quantity: &Quantity) -> Result<u128, String> {
    super::quantity::parse_milli(&quantity.0).map_err(|_| quantity.0.clone())
}

fn same_list(a: Option<&BTreeMap<String, Quantity>>, b: Option<&BTreeMap<String, Quantity>>) -> bool {
    let empty = BTreeMap::new();
    let (a, b) = (a.unwrap_or(&empty), b.unwrap_or(&empty));
    a.len() == b.len() && a.iter().all(|(k, v)| b.get(k).is_some_and(|w| value(v) == value(w)))
}

/// Whether two sizes are the same (`1000m` equals `1`; no list equals an
/// empty one).
pub(crate) fn same(a: &ResourceRequirements, b: &ResourceRequirements) -> bool {
    same_list(a.limits.as_ref(), b.limits.as_ref()) && same_list(a.requests.as_ref(), b.requests.as_ref())
}

fn changed(a: &ResourceRequirements, b: &ResourceRequirements, resource: &str) -> bool {
    let get = |r: &ResourceRequirements, requests: bool| {
        let list = if requests { r.requests.as_ref() } else { r.limits.as_ref() };
        list.and_then(|l| l.get(resource)).map(value)
    };
    get(a, true) != get(b, true) || get(a, false) != get(b, false)
}

/// Whether moving `container` from `from` to `to` restarts it: a changed
/// resource whose `resizePolicy` is `RestartContainer`.
pub(crate) fn needs_restart(container: &Container, from: &ResourceRequirements, to: &ResourceRequirements) -> bool {
    container
        .resize_policy
        .iter()
        .flatten()
        .any(|policy| policy.restart_policy == "RestartContainer" && changed(from, to, &policy.resource_name))
}

/// The larger of two sizes, resource by resource: a request is the larger
/// one; a limit is the larger one, none if either has none.
fn larger(a: &ResourceRequirements, b: &ResourceRequirements) -> ResourceRequirements {
    fn pick<'a>(x: &'a Quantity, y: &'a Quantity) -> &'a Quantity {
        if value(x).unwrap_or(0) >= value(y).unwrap_or(0) { x } else { y }
    }
    let mut requests = a.requests.clone().unwrap_or_default();
    for (name, quantity) in b.requests.iter().flatten() {
        let chosen = requests.get(name).map_or(quantity, |q| pick(q, quantity)).clone();
        requests.insert(name.clone(), chosen);
    }
    let (empty_a, empty_b) = (BTreeMap::new(), BTreeMap::new());
    let (la, lb) = (a.limits.as_ref().unwrap_or(&empty_a), b.limits.as_ref().unwrap_or(&empty_b));
    let limits: BTreeMap<String, Quantity> =
        la.iter().filter_map(|(name, x)| lb.get(name).map(|y| (name.clone(), pick(x, y).clone()))).collect();
    ResourceRequirements {
        requests: Some(requests).filter(|r| !r.is_empty()),
        limits: Some(limits).filter(|l| !l.is_empty()),
        ..a.clone()
    }
}

/// What a resize must do now, if anything: the resizable containers whose
/// size in `desired` differs from what `data` allocated.
fn wanted(desired: &Pod, data: &PodData) -> Allocation {
    let allocated = allocation_of(data);
    sizes(desired).into_iter().filter(|(name, size)| allocated.get(name).is_some_and(|a| !same(a, size))).collect()
}

/// Upstream's test for a static pod (its config source is a file or URL).
fn is_static(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("kubernetes.io/config.source"))
        .is_some_and(|source| source != "api")
}

/// Whether a resize is being actuated: a running container has not been
/// given its allocation yet, or the last try failed.
pub(crate) fn in_progress(data: &PodData) -> bool {
    data.resize.error.is_some()
        || data.containers.values().any(|c| {
            c.is_running()
                && c.actuated.as_ref().is_some_and(|a| !same(a, &c.spec.resources.clone().unwrap_or_default()))
        })
}

/// Judges the pod's latest manifest against its allocation: allocates a
/// new size that fits (and actuates it), or says why it waits.
pub(crate) async fn apply(ctx: &mut Context<PodLifecycle>) {
    let desired = ctx.latest_manifest();
    let changes = wanted(&desired, &ctx.data);
    let uid = ctx.data.id.uid.clone();
    if changes.is_empty() {
        ctx.data.resize.pending = None;
        actuate(ctx).await;
        return;
    }
    if is_static(&desired) {
        pend(ctx, INFEASIBLE, "In-place resize of static-pods is not supported".to_owned());
        return;
    }
    let candidate = with_allocation(&ctx.data.pod, &changes);
    let allocatable = ctx.machine.config.allocatable;
    let requests = match pod_requests(&candidate) {
        Ok(requests) => requests,
        Err(error) => {
            pend(ctx, INFEASIBLE, format!("resource requests: {error}"));
            return;
        }
    };
    let short = if requests.memory > allocatable.memory {
        Some(format!("memory, requested: {}, capacity: {}", requests.memory, allocatable.memory))
    } else if requests.cpu_milli > allocatable.cpu_milli {
        Some(format!("cpu, requested: {}, capacity: {}", requests.cpu_milli, allocatable.cpu_milli))
    } else {
        None
    };
    if let Some(short) = short {
        pend(ctx, INFEASIBLE, format!("Node didn't have enough capacity: {short}"));
        return;
    }
    let overhead = ctx.machine.provider.as_ref().map_or(0, |p| p.pod_overhead(&candidate));
    if let Err(rejection) = ctx.machine.admitted.resize(&uid, &candidate, allocatable, overhead) {
        pend(ctx, DEFERRED, rejection.message);
        wait_for_release(ctx);
        return;
    }
    // Allocated: recorded before anything is actuated.
    for (name, size) in &changes {
        if let Some(record) = ctx.data.containers.get_mut(name) {
            record.spec.resources = Some(size.clone()).filter(|r| !is_empty(r));
        }
    }
    ctx.data.pod = Arc::new(candidate);
    ctx.data.resize.pending = None;
    if let Err(error) = write_checkpoint(&ctx.machine.config.root_dir, &uid, &allocation_of(&ctx.data)) {
        tracing::warn!(pod.uid = %uid, %error, "could not record the resize's allocation; a node restart judges it again");
    }
    tracing::info!(
        pod.uid = %uid,
        pod = %ctx.data.id.name,
        containers = ?changes.keys().collect::<Vec<_>>(),
        "resize allocated; actuating it"
    );
    ctx.report(super::status::pod_status(&ctx.data, super::Stage::Running));
    actuate(ctx).await;
}

fn pend(ctx: &mut Context<PodLifecycle>, reason: &str, message: String) {
    let pending = Some((reason.to_owned(), message));
    if ctx.data.resize.pending != pending {
        tracing::info!(pod.uid = %ctx.data.id.uid, ?pending, "resize cannot be allocated now");
        ctx.data.resize.pending = pending;
    }
}

/// A deferred resize is judged again when another pod gives resources back.
fn wait_for_release(ctx: &mut Context<PodLifecycle>) {
    if std::mem::replace(&mut ctx.data.resize.waiting_release, true) {
        return;
    }
    let mut released = ctx.machine.admitted.releases();
    let sender = ctx.data.event_sender.clone();
    // Not supervised: the pod's own task (its JoinSet), aborted when its lifecycle ends.
    ctx.data.waiters.spawn(async move {
        if released.changed().await.is_ok() {
            let _ = sender.send(ContainerEvent::Resize);
        }
    });
}

/// Gives every running container its allocation: the pod's limits first
/// raised to cover the old and new sizes, each container updated (or
/// restarted, as its resize policy says), then the pod's limits set.
pub(crate) async fn actuate(ctx: &mut Context<PodLifecycle>) {
    let Some(provider) = ctx.machine.provider.clone() else { return };
    let due: Vec<String> = ctx
        .data
        .containers
        .values()
        .filter(|c| c.is_running() && !c.resize_restart)
        .filter(|c| c.actuated.as_ref().is_some_and(|a| !same(a, &c.spec.resources.clone().unwrap_or_default())))
        .map(|c| c.spec.name.clone())
        .collect();
    if due.is_empty() {
        ctx.data.resize.error = None;
        return;
    }
    let uid = ctx.data.id.uid.clone();
    // As upstream: a pod memory limit at or below what the pod uses now is
    // not set (the kernel would reclaim or kill); the resize stays in
    // progress with that error and is tried again.
    let totals = kubelet_support::cgroups::pod_totals(&ctx.data.pod);
    if totals.memory_limited && totals.memory_limit > 0 {
        let usage = provider.pod_stats(&ctx.data.pod).await.ok().and_then(|s| s.memory_usage_bytes);
        if let Some(usage) = usage.filter(|u| u128::from(*u) >= totals.memory_limit) {
            let name = ctx.data.pod.metadata.name.clone().unwrap_or_default();
            let error =
                format!("aborting attempt to set pod memory limit less than current memory usage for pod {name}");
            tracing::debug!(pod.uid = %uid, usage, limit = %totals.memory_limit, "resize: the pod uses more than its new limit");
            report_error(ctx, error);
            return;
        }
    }
    let mut covering = (*ctx.data.pod).clone();
    for container in resizable_mut(&mut covering) {
        if let Some(record) = ctx.data.containers.get(&container.name)
            && let Some(actuated) = &record.actuated
        {
            let now = container.resources.clone().unwrap_or_default();
            container.resources = Some(larger(actuated, &now));
        }
    }
    let mut errors = Vec::new();
    if let Err(error) = provider.update_pod_resources(&covering).await {
        errors.push(format!("pod: {error}"));
    }
    let grace = super::spec::grace_period(&ctx.data.pod);
    for name in due {
        let Some(record) = ctx.data.containers.get_mut(&name) else { continue };
        let Some(id) = record.id.clone() else { continue };
        let size = record.spec.resources.clone().unwrap_or_default();
        let old = record.actuated.clone().unwrap_or_default();
        if needs_restart(&record.spec, &old, &size) {
            tracing::info!(pod.uid = %uid, container = %name, "resize: restarting the container, as its resize policy says");
            record.resize_restart = true;
            record.probes.stop();
            if let Err(error) = provider.stop_container(&id, grace).await {
                record.resize_restart = false;
                errors.push(format!("{name}: {error}"));
            }
            continue;
        }
        match provider.update_container_resources(&ctx.data.pod, &id, &record.spec).await {
            Ok(()) => {
                tracing::info!(pod.uid = %uid, container = %name, "resize: container resources updated in place");
                record.actuated = Some(size);
            }
            Err(error) => errors.push(format!("{name}: {error}")),
        }
    }
    if let Err(error) = provider.update_pod_resources(&ctx.data.pod).await {
        errors.push(format!("pod: {error}"));
    }
    if errors.is_empty() {
        ctx.data.resize.error = None;
    } else {
        report_error(ctx, errors.join("; "));
    }
}

/// How long after a failed actuation it is tried again (upstream retries
/// at its pod's next sync).
pub(crate) const RETRY_AFTER_ERROR: std::time::Duration = std::time::Duration::from_secs(10);

/// Records a failed actuation: the condition's `Error` and a `ResizeError`
/// event.
fn report_error(ctx: &mut Context<PodLifecycle>, error: String) {
    tracing::warn!(pod.uid = %ctx.data.id.uid, %error, "resize could not be actuated");
    ctx.data.recorder.pod(
        &ctx.data.pod,
        None,
        crate::events::EventType::Warning,
        "ResizeError",
        format!("Pod resize failed: {error}"),
    );
    ctx.data.resize.error = Some(error);
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerResizePolicy, PodSpec};

    use super::*;

    fn size(requests: &[(&str, &str)], limits: &[(&str, &str)]) -> ResourceRequirements {
        let list = |items: &[(&str, &str)]| {
            (!items.is_empty())
                .then(|| items.iter().map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned()))).collect())
        };
        ResourceRequirements { requests: list(requests), limits: list(limits), ..Default::default() }
    }

    #[test]
    fn sizes_compare_by_value_and_an_empty_list_is_none() {
        assert!(same(&size(&[("cpu", "1")], &[]), &size(&[("cpu", "1000m")], &[])));
        assert!(same(&size(&[], &[]), &ResourceRequirements::default()));
        assert!(!same(&size(&[("cpu", "1")], &[]), &size(&[("cpu", "1")], &[("cpu", "1")])));
        assert!(!same(&size(&[("memory", "1Mi")], &[]), &size(&[("memory", "2Mi")], &[])));
    }

    #[test]
    fn the_covering_size_takes_the_larger_request_and_limit_and_no_limit_over_any() {
        let old = size(&[("cpu", "100m"), ("memory", "64Mi")], &[("cpu", "200m"), ("memory", "128Mi")]);
        let new = size(&[("cpu", "300m"), ("memory", "32Mi")], &[("cpu", "400m")]);
        let both = larger(&old, &new);
        assert!(same(&both, &size(&[("cpu", "300m"), ("memory", "64Mi")], &[("cpu", "400m")])));
    }

    #[test]
    fn only_a_changed_resource_with_restart_container_restarts() {
        let container = Container {
            name: "c".into(),
            resize_policy: Some(vec![
                ContainerResizePolicy { resource_name: "cpu".into(), restart_policy: "NotRequired".into() },
                ContainerResizePolicy { resource_name: "memory".into(), restart_policy: "RestartContainer".into() },
            ]),
            ..Default::default()
        };
        let from = size(&[("cpu", "100m"), ("memory", "64Mi")], &[]);
        assert!(!needs_restart(&container, &from, &size(&[("cpu", "200m"), ("memory", "64Mi")], &[])));
        assert!(needs_restart(&container, &from, &size(&[("cpu", "100m"), ("memory", "96Mi")], &[])));
        assert!(needs_restart(&container, &from, &size(&[("cpu", "100m"), ("memory", "64Mi")], &[("memory", "1Gi")])));
    }

    #[test]
    fn an_allocation_replaces_app_and_sidecar_sizes_only() {
        let pod = Pod {
            spec: Some(PodSpec {
                containers: vec![Container { name: "app".into(), ..Default::default() }],
                init_containers: Some(vec![
                    Container { name: "init".into(), ..Default::default() },
                    Container { name: "side".into(), restart_policy: Some("Always".into()), ..Default::default() },
                ]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let small = size(&[("cpu", "1")], &[]);
        let allocation: Allocation = ["app", "init", "side"].iter().map(|n| ((*n).to_owned(), small.clone())).collect();
        let allocated = with_allocation(&pod, &allocation);
        let spec = allocated.spec.expect("spec");
        assert_eq!(spec.containers[0].resources, Some(small.clone()));
        let init = spec.init_containers.expect("init containers");
        assert_eq!(init[0].resources, None);
        assert_eq!(init[1].resources, Some(small));
        assert_eq!(sizes(&pod).len(), 2);
    }
}
