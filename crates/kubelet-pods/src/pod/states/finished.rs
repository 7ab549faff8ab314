//! Completed and Failed: the pod is done; it stays until removed, but what
//! it held (its admission slot, cpu and memory, its devices, its resource
//! claims, its volumes) is given back at once, as upstream's admission and
//! device manager ignore terminal pods and its `SyncTerminatedPod`
//! unmounts their volumes. AlreadyFinished: the API showed the pod finished when the
//! node took it on (after a node restart): it is never run again.

use k8s_openapi::api::core::v1::PodStatus;
use krator::{Context, State, Transition};

use crate::pod::PodLifecycle;
use crate::pod::status::{Stage, pod_status};

/// Every app container succeeded and none restarts.
pub(crate) struct Completed;

/// The pod failed (rejected, an init container failed, or an app container
/// failed for good).
pub(crate) struct Failed;

/// Frees what a finished pod held for other pods.
async fn release_resources(ctx: &mut Context<PodLifecycle>) {
    // Its containers are done: the tasks watching them, its volume refresh
    // and its manifest watcher end too (a finished pod's volumes are not
    // written again).
    ctx.data.waiters.shutdown().await;
    let lifecycle = std::sync::Arc::clone(&ctx.machine);
    let uid = &ctx.data.id.uid;
    lifecycle.admitted.release(uid);
    if let Some(devices) = &lifecycle.devices
        && devices.free_pod(uid) > 0
        && let Err(error) = devices.persisted().await
    {
        tracing::warn!(pod.uid = %uid, %error, "device checkpoint after the pod finished");
    }
    // Its resource claims too: the claim controller takes a finished pod out
    // of a claim's reservations, and the devices may go to another claim.
    if let Some((claims, _)) = &lifecycle.claims
        && let Err(error) = claims.unprepare_pod(uid).await
    {
        tracing::warn!(pod.uid = %uid, %error, "resource claims not released yet; the node keeps trying");
    }
}

/// A finished pod's volumes are torn down at once, as upstream's
/// `SyncTerminatedPod` unmounts a terminated pod's volumes while the pod
/// object stays (a finished Job's pod): CSI volumes are unpublished (and
/// unstaged with their last user), emptyDirs and tmpfs mounts go, and an
/// evicted pod frees what it filled. What cannot be torn down now is left
/// for the pod's removal, which retries until it is.
async fn release_volumes(ctx: &mut Context<PodLifecycle>) {
    let lifecycle = std::sync::Arc::clone(&ctx.machine);
    let uid = ctx.data.id.uid.clone();
    let mut volumes = std::mem::take(&mut ctx.data.volumes);
    if volumes.is_empty() {
        return;
    }
    let errors = lifecycle.volumes.teardown(&uid, &mut volumes).await;
    if errors.is_empty() {
        tracing::info!(pod.uid = %uid, "the finished pod's volumes were released");
    } else {
        let reasons: Vec<String> = errors.iter().map(ToString::to_string).collect();
        tracing::warn!(pod.uid = %uid, errors = %reasons.join("; "), "a finished pod's volumes are not all torn down yet; its removal retries");
    }
    ctx.data.volumes = volumes;
}

#[async_trait::async_trait]
impl State<PodLifecycle> for Completed {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        release_resources(ctx).await;
        release_volumes(ctx).await;
        std::future::pending().await
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Done)
    }
}

#[async_trait::async_trait]
impl State<PodLifecycle> for Failed {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        release_resources(ctx).await;
        release_volumes(ctx).await;
        std::future::pending().await
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        let mut status = pod_status(&ctx.data, Stage::Done);
        if ctx.data.verdict.is_none() {
            status.phase = Some("Failed".into());
        }
        status
    }
}

/// The API showed the pod Succeeded or Failed when the node took it on: it
/// holds nothing and is never run again; its status stays the API's.
pub(crate) struct AlreadyFinished;

#[async_trait::async_trait]
impl State<PodLifecycle> for AlreadyFinished {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        tracing::info!(pod = %ctx.data.id.full_name(), pod.uid = %ctx.data.id.uid, "the pod finished before; not run again");
        std::future::pending().await
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        ctx.data.pod.status.clone().unwrap_or_default()
    }
}
