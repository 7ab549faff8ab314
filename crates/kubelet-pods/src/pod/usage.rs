//! What the pods' running containers use, as their provider measures it
//! (for `/stats/summary`, `/metrics/resource` and the eviction manager).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubelet_provider::{ContainerId, ContainerStats, Provider};

/// How long one container's stats may take before it is left out.
const STATS_DEADLINE: Duration = Duration::from_secs(2);

/// One container's figures.
pub struct ContainerUsage {
    /// The container's name.
    pub name: String,
    /// Its runtime ID, without the runtime's scheme.
    pub id: String,
    /// Its image, as its status names it.
    pub image: String,
    /// When it started.
    pub started: Option<jiff::Timestamp>,
    /// What its provider measured (empty when it could not).
    pub stats: ContainerStats,
}

/// One pod's figures.
pub struct PodUsage {
    /// The pod's name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// Its UID.
    pub uid: String,
    /// When it started.
    pub started: Option<jiff::Timestamp>,
    /// Its running containers.
    pub containers: Vec<ContainerUsage>,
}

/// Reads every running container's stats, at once, each within a deadline;
/// whether some read failed.
pub async fn pod_usage(pods: Vec<Pod>, provider: Option<&Arc<dyn Provider>>) -> (Vec<PodUsage>, bool) {
    let mut usage = Vec::new();
    let mut reads = Vec::new();
    for pod in pods {
        let status = pod.status.unwrap_or_default();
        let mut containers = Vec::new();
        for container in status.container_statuses.into_iter().flatten() {
            let Some(running) = container.state.as_ref().and_then(|s| s.running.as_ref()) else { continue };
            let Some(id) = container.container_id.as_deref().map(|id| id.split_once("://").map_or(id, |(_, raw)| raw))
            else {
                continue;
            };
            containers.push(ContainerUsage {
                name: container.name.clone(),
                id: id.to_owned(),
                image: container.image.clone(),
                started: running.started_at.as_ref().map(|t| t.0),
                stats: ContainerStats::default(),
            });
        }
        usage.push(PodUsage {
            name: pod.metadata.name.unwrap_or_default(),
            namespace: pod.metadata.namespace.unwrap_or_default(),
            uid: pod.metadata.uid.unwrap_or_default(),
            started: status.start_time.map(|t| t.0),
            containers,
        });
    }
    let mut failed = false;
    if let Some(provider) = provider {
        for (p, pod) in usage.iter().enumerate() {
            for (c, container) in pod.containers.iter().enumerate() {
                let id = ContainerId(container.id.clone());
                let provider = Arc::clone(provider);
                reads.push(async move {
                    let read = tokio::time::timeout(STATS_DEADLINE, provider.container_stats(&id)).await;
                    (p, c, read)
                });
            }
        }
        for (p, c, read) in futures_util::future::join_all(reads).await {
            match read {
                Ok(Ok(stats)) => usage[p].containers[c].stats = stats,
                Ok(Err(error)) if error.kind == kubelet_provider::ProviderErrorKind::Unsupported => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, container = %usage[p].containers[c].id, "no stats for a container");
                    failed = true;
                }
                Err(_) => {
                    tracing::debug!(container = %usage[p].containers[c].id, "container stats timed out");
                    failed = true;
                }
            }
        }
    }
    (usage, failed)
}
