//! The node's garbage collection, through its provider, on upstream's
//! periods: exited containers every minute (the newest of each container
//! kept), unused images every five minutes (when the image file system is
//! fuller than the high threshold). Failures are Warning events on the
//! Node, with upstream's reasons: `ContainerGCFailed`, `ImageGCFailed`,
//! `FreeDiskSpaceFailed`.

use std::sync::Arc;
use std::time::Duration;

use kubelet_provider::{ImageGcPolicy, Provider, ProviderErrorKind};
use tokio_util::sync::CancellationToken;

use crate::events::{EventRecorder, EventType};

/// How garbage is collected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GcSettings {
    /// How often exited containers are collected (upstream: 1 min).
    pub container_period: Duration,
    /// Exited containers kept per container of a pod
    /// (`--maximum-dead-containers-per-container`, 1).
    pub keep_per_container: usize,
    /// How often images are collected (upstream: 5 min).
    pub image_period: Duration,
    /// When images are collected.
    pub images: ImageGcPolicy,
}

impl Default for GcSettings {
    fn default() -> Self {
        GcSettings {
            container_period: Duration::from_secs(60),
            keep_per_container: 1,
            image_period: Duration::from_secs(300),
            images: ImageGcPolicy::default(),
        }
    }
}

/// Collects until `shutdown`.
pub async fn run(
    settings: GcSettings,
    provider: Arc<dyn Provider>,
    recorder: EventRecorder,
    node_name: String,
    shutdown: CancellationToken,
) {
    let mut containers = tokio::time::interval(settings.container_period);
    let mut images = tokio::time::interval(settings.image_period);
    for timer in [&mut containers, &mut images] {
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first collection a period after the start, as upstream.
        timer.reset();
    }
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = containers.tick() => collect_containers(&settings, provider.as_ref(), &recorder, &node_name).await,
            _ = images.tick() => {
                collect_images(&settings.images, false, provider.as_ref(), &recorder, &node_name).await;
            }
        }
    }
}

/// One container collection.
pub(crate) async fn collect_containers(
    settings: &GcSettings,
    provider: &dyn Provider,
    recorder: &EventRecorder,
    node: &str,
) {
    match provider.collect_containers(settings.keep_per_container).await {
        Ok(report) if !report.removed.is_empty() => {
            tracing::info!(removed = report.removed.len(), "exited containers collected");
        }
        Ok(_) => {}
        Err(error) if error.kind == ProviderErrorKind::Unsupported => {}
        Err(error) => {
            tracing::warn!(%error, "container garbage collection failed");
            recorder.node(node, EventType::Warning, "ContainerGCFailed", error.message);
        }
    }
}

/// One image collection (`all_unused`: every unused image, the node being
/// short of disk); the bytes freed.
pub(crate) async fn collect_images(
    policy: &ImageGcPolicy,
    all_unused: bool,
    provider: &dyn Provider,
    recorder: &EventRecorder,
    node: &str,
) -> u64 {
    match provider.collect_images(policy, all_unused).await {
        Ok(report) => {
            if !report.removed.is_empty() {
                tracing::info!(removed = report.removed.len(), freed = report.freed, "unused images collected");
            }
            if report.freed < report.wanted {
                let message = format!(
                    "Failed to garbage collect required amount of images. Attempted to free {} bytes, but only found {} bytes eligible to free.",
                    report.wanted, report.freed
                );
                tracing::warn!(%message, "image garbage collection fell short");
                recorder.node(node, EventType::Warning, "FreeDiskSpaceFailed", message);
            }
            report.freed
        }
        Err(error) if error.kind == ProviderErrorKind::Unsupported => 0,
        Err(error) => {
            tracing::warn!(%error, "image garbage collection failed");
            recorder.node(node, EventType::Warning, "ImageGCFailed", error.message);
            0
        }
    }
}
