//! Terminating: everything the pod holds is released, in order, each step
//! running even if an earlier one failed.

use std::sync::Arc;

use k8s_openapi::api::core::v1::PodStatus;
use krator::{Context, State, Transition};

use crate::pod::PodLifecycle;
use crate::pod::containers::{log_dir, stop_all};
use crate::pod::spec::grace_period;
use crate::pod::status::{Stage, pod_status};

/// The pod was removed.
pub struct Terminating;

#[async_trait::async_trait]
impl State<PodLifecycle> for Terminating {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        let lifecycle = Arc::clone(&ctx.machine);
        let uid = ctx.data.id.uid.clone();
        tracing::info!(pod = %ctx.data.id.full_name(), pod.uid = %uid, "pod removed: releasing what it holds");
        let mut failures: Vec<String> = Vec::new();
        // 1. Containers, within the grace period.
        let grace = grace_period(&ctx.latest_manifest());
        failures.extend(stop_all(ctx, grace).await);
        ctx.data.waiters.abort_all();
        // 2. Volumes.
        let mut volumes = std::mem::take(&mut ctx.data.volumes);
        for error in lifecycle.volumes.teardown(&uid, &mut volumes).await {
            failures.push(error.to_string());
        }
        // 3. Devices (the checkpoint is rewritten).
        if let Some(devices) = &lifecycle.devices {
            devices.free_pod(&uid);
            if let Err(error) = devices.persisted().await {
                failures.push(format!("device checkpoint: {error}"));
            }
        }
        // 4. What the provider keeps, and the pod's logs.
        if let Some(provider) = &lifecycle.provider
            && let Err(error) = provider.remove_pod(&uid).await
        {
            failures.push(format!("provider: {error}"));
        }
        let logs = log_dir(&lifecycle, &ctx.data);
        if let Err(error) = std::fs::remove_dir_all(&logs)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            failures.push(format!("logs {}: {error}", logs.display()));
        }
        lifecycle.admitted.release(&uid);
        for failure in &failures {
            tracing::warn!(pod.uid = %uid, %failure, "a removal step failed");
        }
        tracing::info!(pod.uid = %uid, failed_steps = failures.len(), "pod released");
        if failures.is_empty() { Transition::complete(Ok(())) } else { Transition::complete(Err(failures.join("; "))) }
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Terminating)
    }
}
