//! Terminating: everything the pod holds is released, in order, each step
//! running even if an earlier one failed. It runs when the pod is removed,
//! and when a state of the pod's lifecycle panicked: then the pod ends
//! Failed (with the panic in its message) instead of going.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::PodStatus;
use krator::{Context, State, Transition};

use crate::pod::PodLifecycle;
use crate::pod::containers::{log_dir, stop_all};
use crate::pod::data::{ContainerPhase, Terminated};
use crate::pod::spec::grace_period;
use crate::pod::status::{Stage, pod_status};

/// The pod was removed, or its lifecycle failed.
pub(crate) struct Terminating {
    /// Why the pod is released without having been removed: a state
    /// panicked (the message); then it ends Failed.
    failed: Option<String>,
}

/// The reason of a pod whose lifecycle failed (a state panicked).
pub const LIFECYCLE_ERROR: &str = "PodLifecycleError";

impl Terminating {
    /// The pod was removed.
    pub(crate) fn removed() -> Terminating {
        Terminating { failed: None }
    }

    /// A state of the pod's lifecycle panicked with `message`.
    pub(crate) fn after_panic(message: &str) -> Terminating {
        Terminating { failed: Some(message.to_owned()) }
    }
}

/// How long the exits of the containers just stopped are waited for.
const STOPPED_EXITS: Duration = Duration::from_secs(10);

/// How many times the provider is asked to remove a pod before the
/// failure is reported.
const PROVIDER_REMOVAL_ATTEMPTS: u32 = 5;

#[async_trait::async_trait]
impl State<PodLifecycle> for Terminating {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        let lifecycle = Arc::clone(&ctx.machine);
        let uid = ctx.data.id.uid.clone();
        let began = std::time::Instant::now();
        match &self.failed {
            None => {
                tracing::info!(pod = %ctx.data.id.full_name(), pod.uid = %uid, "pod removed: releasing what it holds")
            }
            Some(panic) => tracing::error!(
                pod = %ctx.data.id.full_name(),
                pod.uid = %uid,
                %panic,
                "the pod's lifecycle failed: releasing what it holds; the pod ends Failed"
            ),
        }
        let mut failures: Vec<String> = Vec::new();
        // 1. Containers, within the grace period.
        let grace = grace_period(&ctx.latest_manifest());
        failures.extend(stop_all(ctx, grace).await);
        // How the containers ended is the pod's last status, as upstream
        // reports a terminated pod (the API gets it before the deletion is
        // finished): the exits of the stopped containers are recorded;
        // one never seen is `ContainerStatusUnknown`, 137, as upstream.
        super::containers::await_exits(ctx, STOPPED_EXITS).await;
        for record in ctx.data.containers.values_mut() {
            if let ContainerPhase::Running { started_at } = record.phase {
                record.phase = ContainerPhase::Terminated(Terminated {
                    exit_code: 137,
                    reason: "ContainerStatusUnknown".into(),
                    message: Some("The container could not be located when the pod was terminated".into()),
                    started_at: Some(started_at),
                    finished_at: k8s_openapi::jiff::Timestamp::now(),
                    container_id: record.id.clone(),
                });
            }
        }
        ctx.report(pod_status(&ctx.data, stage_of(&ctx.data)));
        // Waited for, not only aborted: a volume refresh between its API
        // read and its write must not write after the teardown below.
        ctx.data.waiters.shutdown().await;
        // 2. Volumes: retried with backoff until every one is torn down
        // (a CSI driver may fail NodeUnpublishVolume for a while); the
        // pod's deletion in the API waits for it.
        let mut volumes = std::mem::take(&mut ctx.data.volumes);
        let backoff = &lifecycle.config.volume_backoff;
        let mut backoff = crate::retry::RetryBackoff::new(backoff.initial, backoff.max);
        loop {
            let errors = lifecycle.volumes.teardown(&uid, &mut volumes).await;
            if errors.is_empty() {
                break;
            }
            let delay = backoff.next_delay();
            let reasons: Vec<String> = errors.iter().map(ToString::to_string).collect();
            tracing::warn!(pod.uid = %uid, errors = %reasons.join("; "), retry_in = ?delay, "volumes not torn down; retrying");
            ctx.data.pending_message = Some(format!("volumes not torn down yet: {}", reasons.join("; ")));
            ctx.report(pod_status(&ctx.data, stage_of(&ctx.data)));
            tokio::time::sleep(delay).await;
        }
        ctx.data.pending_message = None;
        // 3. Devices (the checkpoint is rewritten).
        if let Some(devices) = &lifecycle.devices {
            devices.free_pod(&uid);
            if let Err(error) = devices.persisted().await {
                failures.push(format!("device checkpoint: {error}"));
            }
        }
        // 3b. Resource claims this pod was the last user of are released.
        // One that its driver does not release now stays in the checkpoint
        // and is released in the background (when the driver is back, and
        // periodically): a driver never holds up the pod's removal.
        if let Some((claims, _)) = &lifecycle.claims
            && let Err(error) = claims.unprepare_pod(&uid).await
        {
            tracing::warn!(pod.uid = %uid, %error, "resource claims not released yet; the node keeps trying");
        }
        // 4. What the provider keeps (a runtime's teardown can fail for a
        // moment, a CNI plugin racing the network namespace's removal:
        // tried a few times with backoff), and the pod's logs.
        if let Some(provider) = &lifecycle.provider {
            let mut backoff = crate::retry::RetryBackoff::new(Duration::from_millis(200), Duration::from_secs(5));
            for attempt in 1..=PROVIDER_REMOVAL_ATTEMPTS {
                match provider.remove_pod(&uid).await {
                    Ok(()) => break,
                    Err(error) if attempt < PROVIDER_REMOVAL_ATTEMPTS => {
                        let delay = backoff.next_delay();
                        tracing::warn!(pod.uid = %uid, %error, attempt, retry_in = ?delay, "the provider could not remove the pod; retrying");
                        tokio::time::sleep(delay).await;
                    }
                    Err(error) => failures.push(format!("provider: {error}")),
                }
            }
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
        lifecycle.metrics.pod_worker(crate::metrics::WorkerOperation::Kill, began.elapsed());
        if let Some(panic) = &self.failed {
            ctx.data.verdict = Some(crate::pod::data::PodVerdict {
                phase: "Failed",
                reason: Some(LIFECYCLE_ERROR.into()),
                message: Some(format!(
                    "the node's lifecycle of this pod failed ({panic}); its containers were stopped and what it held released"
                )),
                rejected: false,
                disruption: false,
            });
            return Transition::next(&*self, super::Failed);
        }
        if failures.is_empty() { Transition::complete(Ok(())) } else { Transition::complete(Err(failures.join("; "))) }
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, stage_of(&ctx.data))
    }
}

/// A removed pod's stage: done once every app container has ended (its
/// phase is then terminal, as upstream's for a terminated pod, and never
/// reverts); terminating before, which is `Pending` while a container has
/// never run.
fn stage_of(data: &crate::pod::data::PodData) -> Stage {
    let apps_ended = data
        .containers
        .values()
        .filter(|c| c.kind == crate::provider::ContainerKind::App)
        .all(|c| matches!(c.phase, ContainerPhase::Terminated(_)));
    if apps_ended { Stage::Done } else { Stage::Terminating }
}
