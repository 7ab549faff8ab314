//! ImagePull, ImagePullBackOff, Volumes and NoProvider: what happens before
//! containers start.

use std::sync::Arc;

use crate::events::EventType;
use k8s_openapi::api::core::v1::PodStatus;
use krator::{Context, State, Transition};
use tokio::time::Instant;

use super::{Failed, Initializing};
use crate::pod::PodLifecycle;
use crate::pod::backoff::Backoff;
use crate::pod::status::{Stage, pod_status};
use crate::volume::VolumeError;

/// How often a pod waiting for an unregistered CSI driver checks again even
/// without a registry change (a safety net; registrations wake it at once).
const MISSING_DRIVER_RECHECK: std::time::Duration = std::time::Duration::from_secs(60);

/// How often a pod waiting for its volume's VolumeAttachment reads it again.
const ATTACH_RECHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// The provider prepares every container's image.
pub(crate) struct ImagePull {
    backoff: Backoff,
}

impl ImagePull {
    pub(crate) fn first() -> Self {
        ImagePull { backoff: Backoff::default() }
    }
}

#[async_trait::async_trait]
impl State<PodLifecycle> for ImagePull {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        let Some(provider) = ctx.machine.provider.clone() else {
            return Transition::next(&*self, Volumes);
        };
        let pod = Arc::clone(&ctx.data.pod);
        let secrets = match ctx.machine.volumes.objects() {
            Some(objects) if ctx.data.containers.values().any(|r| r.image_id.is_none()) => {
                crate::volume::api_data::pull_secrets(objects.as_ref(), &pod).await
            }
            _ => crate::provider::PullSecrets::default(),
        };
        for name in ctx.data.order.clone() {
            let Some(record) = ctx.data.containers.get(&name) else { continue };
            if record.image_id.is_some() {
                continue;
            }
            let spec = record.spec.clone();
            let image_name = spec.image.clone().unwrap_or_default();
            let asked = Instant::now();
            // A pull is known to happen under policy Always; otherwise the
            // provider may find the image present.
            let policy = crate::provider::PullPolicy::of(spec.image_pull_policy.as_deref(), &image_name);
            if policy == crate::provider::PullPolicy::Always {
                let message = format!("Pulling image {image_name:?}");
                ctx.data.recorder.pod(&pod, Some(&name), EventType::Normal, "Pulling", message);
            }
            match provider.prepare_image_with_secrets(&pod, &spec, &secrets).await {
                Ok(image) => {
                    let took = asked.elapsed();
                    let message = format!("Container image {image_name:?} ready in {took:?} ({})", image.image_id);
                    ctx.data.recorder.pod(&pod, Some(&name), EventType::Normal, "Pulled", message);
                    if let Some(record) = ctx.data.containers.get_mut(&name) {
                        record.image_id = Some(image.image_id);
                    }
                }
                Err(error) => {
                    tracing::warn!(pod.uid = %ctx.data.id.uid, container = %name, %error, "image pull failed");
                    let (reason, message) = match error.kind {
                        crate::provider::ProviderErrorKind::ImageNeverPull => {
                            ("ErrImageNeverPull", error.message.clone())
                        }
                        crate::provider::ProviderErrorKind::Config => ("Failed", format!("Error: {error}")),
                        _ => ("Failed", format!("Failed to pull image {image_name:?}: {error}")),
                    };
                    ctx.data.recorder.pod(&pod, Some(&name), EventType::Warning, reason, message);
                    let mut backoff = self.backoff.clone();
                    let delay =
                        backoff.fail(&ctx.machine.config.image_backoff, std::time::Duration::ZERO, Instant::now());
                    // A container the node cannot run as configured (its
                    // RuntimeClass has no runtime here, say) is not an image
                    // problem: it keeps its reason through the backoff.
                    // Neither is an image that policy Never forbids pulling:
                    // upstream keeps `ErrImageNeverPull` (no pull to back off).
                    let (keep_reason, reason) = match error.kind {
                        crate::provider::ProviderErrorKind::Config => (true, "CreateContainerConfigError"),
                        crate::provider::ProviderErrorKind::ImageNeverPull => (true, "ErrImageNeverPull"),
                        _ => (false, "ErrImagePull"),
                    };
                    if let Some(record) = ctx.data.containers.get_mut(&name) {
                        record.phase = crate::pod::ContainerPhase::Waiting {
                            reason: reason.into(),
                            message: Some(error.message.clone()),
                        };
                    }
                    ctx.report(pod_status(&ctx.data, Stage::Pending));
                    return Transition::next(
                        &*self,
                        ImagePullBackOff {
                            backoff,
                            container: name,
                            image: spec.image.unwrap_or_default(),
                            delay,
                            keep_reason,
                        },
                    );
                }
            }
        }
        Transition::next(&*self, Volumes)
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Pending)
    }
}

/// Waiting out an image pull's backoff.
pub(crate) struct ImagePullBackOff {
    backoff: Backoff,
    container: String,
    image: String,
    delay: std::time::Duration,
    /// The failure was not a pull's (the container's configuration, or
    /// policy Never): its reason and message stay as they are.
    keep_reason: bool,
}

#[async_trait::async_trait]
impl State<PodLifecycle> for ImagePullBackOff {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        if !self.keep_reason {
            let message = format!("Back-off pulling image {:?}", self.image);
            ctx.data.recorder.pod(&ctx.data.pod, Some(&self.container), EventType::Normal, "BackOff", message);
        }
        if let Some(until) = self.backoff.until() {
            // A pod past its activeDeadlineSeconds fails here too (a Job
            // whose image cannot be pulled).
            tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                () = super::containers::deadline_event(&mut ctx.data) => return Transition::next(&*self, Failed),
            }
        }
        let mut backoff = self.backoff.clone();
        backoff.waited();
        Transition::next(&*self, ImagePull { backoff })
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        let mut status = pod_status(&ctx.data, Stage::Pending);
        if self.keep_reason {
            return status;
        }
        for s in status.container_statuses.iter_mut().chain(status.init_container_statuses.iter_mut()).flatten() {
            if s.name == self.container
                && let Some(waiting) = s.state.as_mut().and_then(|st| st.waiting.as_mut())
            {
                waiting.reason = Some("ImagePullBackOff".into());
                waiting.message = Some(format!("Back-off {:?} pulling image {:?}", self.delay, self.image));
            }
        }
        status
    }
}

/// The pod's volumes are prepared; retried with backoff until they are.
#[derive(Default)]
pub(crate) struct Volumes;

#[async_trait::async_trait]
impl State<PodLifecycle> for Volumes {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        let lifecycle = Arc::clone(&ctx.machine);
        let mut backoff = Backoff::default();
        // A driver registering (or going away) is a reason to try again at
        // once; the backoff is for errors nothing announces the end of.
        let mut changes = lifecycle.volumes.changes();
        loop {
            if let Some(changes) = changes.as_mut() {
                changes.mark_unchanged();
            }
            let pod = Arc::clone(&ctx.data.pod);
            let context = lifecycle.downward_context(&ctx.data);
            match lifecycle.volumes.prepare(&pod, &mut ctx.data.volumes, &context).await {
                Ok(()) => break,
                Err(error) => {
                    tracing::warn!(pod.uid = %ctx.data.id.uid, %error, "volumes not ready");
                    let message = format!("volumes not ready: {error}");
                    // One event per distinct error (the retries of one wait
                    // would use up the pod's events).
                    if ctx.data.pending_message.as_deref() != Some(message.as_str()) {
                        let event = format!("MountVolume failed: {error}");
                        ctx.data.recorder.pod(&ctx.data.pod, None, EventType::Warning, "FailedMount", event);
                    }
                    ctx.data.pending_message = Some(message);
                    ctx.report(pod_status(&ctx.data, Stage::Pending));
                    let waiting_for_driver = matches!(error, VolumeError::DriverNotRegistered { .. });
                    backoff.fail(&lifecycle.config.volume_backoff, std::time::Duration::ZERO, Instant::now());
                    let mut until = backoff.until().unwrap_or_else(Instant::now);
                    // An attachment is the attacher's to finish: look again
                    // soon, whatever the backoff says.
                    if matches!(error, VolumeError::NotAttached { .. }) {
                        until = until.min(Instant::now() + ATTACH_RECHECK);
                    }
                    let wait = async {
                        match changes.as_mut() {
                            Some(changes) if waiting_for_driver => {
                                // Only a registration can help: wait for one
                                // (the backoff's deadline stays as a safety net).
                                let _ = tokio::time::timeout_at(
                                    until.max(Instant::now() + MISSING_DRIVER_RECHECK),
                                    changes.changed(),
                                )
                                .await;
                            }
                            Some(changes) => {
                                let _ = tokio::time::timeout_at(until, changes.changed()).await;
                            }
                            None => tokio::time::sleep_until(until).await,
                        }
                    };
                    tokio::select! {
                        () = wait => {}
                        () = super::containers::deadline_event(&mut ctx.data) => return Transition::next(&*self, Failed),
                    }
                }
            }
        }
        ctx.data.pending_message = None;
        ctx.data.volumes_ready = true;
        spawn_volume_refresh(ctx);
        if lifecycle.provider.is_none() {
            return Transition::next(&*self, NoProvider);
        }
        Transition::next(&*self, Initializing)
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Pending)
    }
}

/// Keeps the pod's configMap, secret, projected and downwardAPI volumes
/// up to date while it runs (until its data is dropped or its removal
/// aborts its tasks): written again every [`PodConfig::volume_refresh`],
/// and at once when the pod's manifest changes (labels, annotations). On
/// the same period, its claimed CSI volumes are expanded when their claims
/// ask the node to (an online expansion), and CSI volumes whose drivers
/// say `requiresRepublish` are published again.
///
/// [`PodConfig::volume_refresh`]: crate::pod::PodConfig::volume_refresh
fn spawn_volume_refresh(ctx: &mut Context<PodLifecycle>) {
    /// The first retry of a failed online expansion.
    const EXPAND_RETRY: std::time::Duration = std::time::Duration::from_secs(2);
    use crate::volume::VolumeKind;
    let prepared = ctx.data.volumes.clone();
    let claimed =
        |v: &crate::volume::PreparedVolume| v.csi.as_ref().is_some_and(|c| c.volume_lifecycle_mode == "Persistent");
    if !prepared.values().any(|v| matches!(v.kind, VolumeKind::ApiData | VolumeKind::DownwardApi | VolumeKind::Csi)) {
        return;
    }
    let expands = prepared.values().any(claimed);
    let publishes = prepared.values().any(|v| v.kind == VolumeKind::Csi);
    let volumes = ctx.machine.volumes.clone();
    let context = ctx.machine.downward_context(&ctx.data);
    let period = ctx.machine.config.volume_refresh;
    let mut manifest = ctx.manifest.clone();
    let uid = ctx.data.id.uid.clone();
    // Pods started together spread their reads over a quarter period.
    let jitter = {
        use std::hash::{Hash as _, Hasher as _};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        uid.hash(&mut hasher);
        period.mul_f64((hasher.finish() % 1000) as f64 / 4000.0)
    };
    let task = async move {
        let mut manifest_open = true;
        let mut next = Instant::now() + period + jitter;
        let mut retry = EXPAND_RETRY / 2;
        // What of the pod its volumes show: a change of anything else (its
        // status, written back by the node) waits for the period.
        let shown =
            |pod: &k8s_openapi::api::core::v1::Pod| (pod.metadata.labels.clone(), pod.metadata.annotations.clone());
        let mut last = shown(&manifest.borrow());
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(next) => next = Instant::now() + period,
                changed = manifest.changed(), if manifest_open => {
                    if changed.is_err() {
                        manifest_open = false;
                        continue;
                    }
                    if shown(&manifest.borrow_and_update()) == last {
                        continue;
                    }
                }
            }
            let pod = Arc::clone(&manifest.borrow_and_update());
            if pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            last = shown(&pod);
            let max_age = (period / 2).min(crate::volume::OBJECT_MAX_AGE);
            if let Err(errors) = volumes.refresh(&pod, &prepared, &context, max_age).await {
                let reasons: Vec<String> = errors.iter().map(ToString::to_string).collect();
                tracing::warn!(pod.uid = %uid, errors = %reasons.join("; "), "volume contents not updated; trying again later");
            }
            if publishes && let Err(errors) = volumes.republish(&pod, &prepared).await {
                let reasons: Vec<String> = errors.iter().map(ToString::to_string).collect();
                tracing::warn!(pod.uid = %uid, errors = %reasons.join("; "), "volume not published again; trying again later");
            }
            let expanded = if expands { Some(volumes.expand(&pod, &prepared).await) } else { None };
            match expanded {
                Some(Err(errors)) => {
                    // As the kubelet's operation backoff: a failed expansion
                    // (a recovery waits on the next try) is tried again
                    // sooner than the period, doubling up to it.
                    retry = (retry * 2).max(EXPAND_RETRY).min(period);
                    next = next.min(Instant::now() + retry);
                    let reasons: Vec<String> = errors.iter().map(ToString::to_string).collect();
                    tracing::warn!(pod.uid = %uid, errors = %reasons.join("; "), retry = ?retry, "volume not expanded; trying again later");
                }
                Some(Ok(_)) => retry = EXPAND_RETRY / 2,
                None => {}
            }
        }
    };
    // Not supervised: the pod's own task (its JoinSet), aborted when its lifecycle ends.
    ctx.data.waiters.spawn(tracing::Instrument::instrument(
        task,
        tracing::info_span!("volume_refresh", pod.uid = %ctx.data.id.uid),
    ));
}

/// The node has no provider: the pod is admitted and its volumes are ready,
/// and it waits (until the node gets a provider or the pod is removed).
pub(crate) struct NoProvider;

/// What a pod on a node without a provider is told.
pub const NO_PROVIDER_MESSAGE: &str =
    "this node has no provider to run containers: admission, devices and volumes are done, the containers wait";

#[async_trait::async_trait]
impl State<PodLifecycle> for NoProvider {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        ctx.data.set_waiting("ContainerCreating", Some(NO_PROVIDER_MESSAGE.into()));
        ctx.data.pending_message = Some(NO_PROVIDER_MESSAGE.into());
        ctx.report(pod_status(&ctx.data, Stage::Pending));
        std::future::pending().await
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Pending)
    }
}
