//! Claims: the pod's resource claims are resolved through the API and
//! prepared through their DRA drivers before anything else of the pod runs.

use std::sync::Arc;

use k8s_openapi::api::core::v1::PodStatus;
use krator::{Context, State, Transition};

use super::{Failed, ImagePull};
use crate::events::EventType;
use crate::pod::PodLifecycle;
use crate::pod::status::{Stage, pod_status};
use crate::retry::RetryBackoff;

/// The least time between two tries, even when a driver changes.
const MIN_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

/// Why a static pod with claims is refused.
pub(crate) const STATIC_CLAIMS_MESSAGE: &str =
    "static pods cannot use resource claims: no API server allocates a claim to a pod from a manifest";

/// The pod's claims are allocated and reserved for it, then prepared;
/// waited for (with the reason in the pod's status and one event per
/// distinct reason) and retried with backoff, and soon after any change of
/// the DRA drivers (one registers, connects or goes away).
pub(crate) struct Claims;

fn is_static(ctx: &Context<PodLifecycle>) -> bool {
    ctx.data.pod.metadata.annotations.as_ref().and_then(|a| a.get("kubernetes.io/config.source")).map(String::as_str)
        == Some("file")
}

#[async_trait::async_trait]
impl State<PodLifecycle> for Claims {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        let has_claims =
            ctx.data.pod.spec.as_ref().and_then(|s| s.resource_claims.as_ref()).is_some_and(|c| !c.is_empty());
        if !has_claims {
            return Transition::next(&*self, ImagePull::first());
        }
        let lifecycle = Arc::clone(&ctx.machine);
        let (claims, source) = match &lifecycle.claims {
            Some((claims, Some(source))) if !is_static(ctx) => (claims.clone(), Arc::clone(source)),
            _ => {
                super::admission::reject(ctx, "InvalidPod", STATIC_CLAIMS_MESSAGE.into());
                return Transition::next(&*self, Failed);
            }
        };
        let uid = ctx.data.id.uid.clone();
        let mut backoff = RetryBackoff::new(std::time::Duration::from_millis(200), std::time::Duration::from_secs(10));
        let mut changes = claims.drivers().changes();
        loop {
            changes.mark_unchanged();
            // The latest pod: a template's claim is named in its status,
            // which may come after the pod was bound.
            ctx.data.pod = Arc::new(crate::pod::resize::allocated_pod(&ctx.latest_manifest(), &ctx.data));
            let pod = Arc::clone(&ctx.data.pod);
            let outcome = match source.resolve(&pod).await {
                Ok(resolved) => claims.prepare_pod(&uid, &resolved).await,
                Err(error) => Err(error),
            }
            .map_err(|e| e.to_string());
            match outcome {
                Ok(()) => break,
                Err(reason) => {
                    tracing::warn!(pod.uid = %uid, %reason, "resource claims not ready");
                    let message = format!("resource claims not ready: {reason}");
                    if ctx.data.pending_message.as_deref() != Some(message.as_str()) {
                        ctx.data.recorder.pod(&pod, None, EventType::Warning, "FailedPrepareDynamicResources", reason);
                    }
                    ctx.data.pending_message = Some(message);
                    ctx.report(pod_status(&ctx.data, Stage::Pending));
                    let delay = backoff.next_delay();
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = changes.changed() => {
                            // A driver flapping must not turn this into a
                            // busy loop: a short pause even then.
                            tokio::time::sleep(delay.min(MIN_RETRY)).await;
                        }
                    }
                }
            }
        }
        ctx.data.pending_message = None;
        tracing::info!(pod.uid = %uid, "resource claims prepared");
        Transition::next(&*self, ImagePull::first())
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Pending)
    }
}
