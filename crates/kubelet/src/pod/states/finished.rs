//! Completed and Failed: the pod is done; it stays until removed.

use k8s_openapi::api::core::v1::PodStatus;
use krator::{Context, State, Transition};

use crate::pod::PodLifecycle;
use crate::pod::status::{Stage, pod_status};

/// Every app container succeeded and none restarts.
pub struct Completed;

/// The pod failed (rejected, an init container failed, or an app container
/// failed for good).
pub struct Failed;

#[async_trait::async_trait]
impl State<PodLifecycle> for Completed {
    async fn next(self: Box<Self>, _ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        std::future::pending().await
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Done)
    }
}

#[async_trait::async_trait]
impl State<PodLifecycle> for Failed {
    async fn next(self: Box<Self>, _ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
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
