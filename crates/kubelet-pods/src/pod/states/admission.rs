//! Registered and Resources: the pod is checked, admitted, and given its
//! devices.

use k8s_openapi::api::core::v1::PodStatus;
use krator::{Context, State, Transition};

use super::{AlreadyFinished, Claims, Failed};
use crate::device_manager::{PodContainer, PodDeviceRequest};
use crate::pod::PodLifecycle;
use crate::pod::data::PodVerdict;
use crate::pod::spec::{containers, extended_limits};
use crate::pod::status::{Stage, pod_status};

/// The pod is known to the node.
pub(crate) struct Registered;

#[async_trait::async_trait]
impl State<PodLifecycle> for Registered {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        tracing::info!(pod = %ctx.data.id.full_name(), pod.uid = %ctx.data.id.uid, "pod added");
        let phase = ctx.data.pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            return Transition::next(&*self, AlreadyFinished);
        }
        if ctx.data.pod.spec.as_ref().is_none_or(|s| s.containers.is_empty()) {
            reject(ctx, "InvalidPod", "the pod has no containers".into());
            return Transition::next(&*self, Failed);
        }
        // Upstream's admission: a pod for another operating system, and
        // sysctls the node does not allow, are refused.
        let os = ctx.data.pod.spec.as_ref().and_then(|s| s.os.as_ref()).map(|os| os.name.clone());
        if let Some(os) = os.filter(|os| os != std::env::consts::OS) {
            tracing::info!(pod.uid = %ctx.data.id.uid, %os, "the pod is for another operating system");
            reject(ctx, "PodOSNotSupported", "Failed to admit pod as the OS field doesn't match node OS".into());
            return Transition::next(&*self, Failed);
        }
        // `supplementalGroupsPolicy: Strict` where the runtime cannot honour
        // it: the image's groups would be added behind the pod's back.
        if asks_strict_supplemental_groups(&ctx.data.pod)
            && !ctx.machine.provider.as_ref().is_some_and(|p| p.supports_strict_supplemental_groups())
        {
            tracing::info!(pod.uid = %ctx.data.id.uid, "the runtime cannot honour supplementalGroupsPolicy: Strict");
            reject(
                ctx,
                SUPPLEMENTAL_GROUPS_POLICY_NOT_SUPPORTED,
                "SupplementalGroupsPolicy=Strict is not supported in this node".into(),
            );
            return Transition::next(&*self, Failed);
        }
        if let Err(refused) = crate::pod::sysctls::check(&ctx.data.pod, &ctx.machine.config.allowed_unsafe_sysctls) {
            reject(ctx, crate::pod::sysctls::SYSCTL_FORBIDDEN, refused.to_string());
            return Transition::next(&*self, Failed);
        }
        // Under pressure (upstream's eviction admission).
        if let Err(refused) = ctx.machine.config.pressure.admit(&ctx.data.pod) {
            reject(ctx, crate::pod::EVICTED, refused.to_string());
            return Transition::next(&*self, Failed);
        }
        // Ephemeral containers added and `activeDeadlineSeconds` running
        // out reach the states as events from here on.
        let manifest = ctx.manifest.clone();
        crate::pod::containers::watch_manifest(&mut ctx.data, manifest);
        Transition::next(&*self, Resources)
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Pending)
    }
}

/// Admission: pod count, cpu, memory, extended resources; then the devices.
pub(crate) struct Resources;

#[async_trait::async_trait]
impl State<PodLifecycle> for Resources {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        let lifecycle = std::sync::Arc::clone(&ctx.machine);
        let capacities = lifecycle.devices.as_ref().map(|d| d.capacity().borrow().clone()).unwrap_or_default();
        let uid = ctx.data.id.uid.clone();
        let held = |container: &str, resource: &str| {
            lifecycle
                .devices
                .as_ref()
                .and_then(|d| d.allocated(&uid, container).get(resource).map(Vec::len))
                .unwrap_or(0)
        };
        let overhead = lifecycle.provider.as_ref().map_or(0, |p| p.pod_overhead(&ctx.data.pod));
        let admitted =
            lifecycle.admitted.admit(&uid, &ctx.data.pod, lifecycle.config.allocatable, &capacities, held, overhead);
        if let Err(rejection) = admitted {
            reject(ctx, &rejection.reason, rejection.message);
            return Transition::next(&*self, Failed);
        }
        ctx.data.admitted = true;
        if let Some(devices) = &lifecycle.devices {
            let mut request =
                PodDeviceRequest { pod_uid: uid.clone(), pod_name: ctx.data.id.name.clone(), containers: Vec::new() };
            for (kind, container) in containers(&ctx.data.pod) {
                let limits = extended_limits(container).unwrap_or_default();
                request.containers.push(PodContainer { name: container.name.clone(), kind, limits });
            }
            match devices.allocate_pod(&request).await {
                Ok(allocated) => ctx.data.devices = allocated,
                Err(error) => {
                    let message = format!("Allocate failed due to {error}, which is unexpected");
                    reject(ctx, "UnexpectedAdmissionError", message);
                    return Transition::next(&*self, Failed);
                }
            }
        }
        tracing::info!(pod.uid = %uid, "pod admitted");
        Transition::next(&*self, Claims)
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Pending)
    }
}

/// Marks the pod rejected (upstream's phase, reason and message).
/// The status is published before the log line, so whoever reads the line
/// finds the pod rejected.
/// The reason a pod asking for a `supplementalGroupsPolicy` the runtime
/// cannot honour is refused with (upstream's).
pub(crate) const SUPPLEMENTAL_GROUPS_POLICY_NOT_SUPPORTED: &str = "SupplementalGroupsPolicyNotSupported";

/// Whether the pod asks for `supplementalGroupsPolicy: Strict`.
fn asks_strict_supplemental_groups(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    let policy = pod.spec.as_ref().and_then(|s| s.security_context.as_ref()?.supplemental_groups_policy.as_deref());
    policy == Some("Strict")
}

pub(super) fn reject(ctx: &mut Context<PodLifecycle>, reason: &str, message: String) {
    ctx.data.verdict = Some(PodVerdict {
        phase: "Failed",
        reason: Some(reason.to_owned()),
        message: Some(format!("Pod was rejected: {message}")),
        rejected: true,
        disruption: false,
    });
    ctx.report(pod_status(&ctx.data, Stage::Done));
    tracing::warn!(pod = %ctx.data.id.full_name(), pod.uid = %ctx.data.id.uid, reason, %message, "pod rejected");
    ctx.data.recorder.pod(&ctx.data.pod, None, crate::events::EventType::Warning, reason, message);
}
