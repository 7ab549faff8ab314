//! The relist: the runtime's containers listed every
//! [`crate::metrics::RELIST_PERIOD`], the kubelet's PLEG series and running
//! counts taken from it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

/// The relist: every [`crate::metrics::RELIST_PERIOD`] until `shutdown`, the provider's
/// running containers are listed and counted (`kubelet_running_pods`,
/// `kubelet_running_containers`), the list timed as upstream times its
/// PLEG relist. A container the pod store has as running that the runtime
/// no longer lists is logged: its exit event went missing.
pub async fn relist(
    provider: Arc<dyn kubelet_provider::Provider>,
    store: crate::pod::PodStore,
    metrics: crate::metrics::PodMetrics,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut ticks = tokio::time::interval(crate::metrics::RELIST_PERIOD);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let began = Instant::now();
        match provider.list_running().await {
            Ok(running) => {
                let uids: Vec<String> = running.iter().map(|(uid, _)| uid.clone()).collect();
                metrics.relisted(began, &uids);
                let listed: HashSet<&str> = running.iter().map(|(_, id)| id.0.as_str()).collect();
                for (uid, container, id) in running_container_ids(&store) {
                    if !listed.contains(id.as_str()) {
                        tracing::debug!(pod.uid = %uid, container, %id, "the runtime no longer lists a container the node has as running; its exit is on the way");
                    }
                }
            }
            Err(error) if error.kind == kubelet_provider::ProviderErrorKind::Unsupported => {
                tracing::info!(
                    "the provider does not list its running containers: no relist (kubelet_pleg_* stay empty)"
                );
                // Nothing to relist is not a failure: the task stays until
                // shutdown, as the node's supervisor expects of it (a task
                // that ended early fails `/healthz`).
                shutdown.cancelled().await;
                return;
            }
            Err(error) => tracing::warn!(%error, "relist: the provider could not list its running containers"),
        }
    }
}

/// Exited containers in the pods' statuses.
pub fn exited_containers(store: &crate::pod::PodStore) -> usize {
    store.read(|pods| {
        pods.values()
            .filter_map(|p| p.status.as_ref())
            .flat_map(|s| s.init_container_statuses.iter().flatten().chain(s.container_statuses.iter().flatten()))
            .filter(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some()) && c.container_id.is_some())
            .count()
    })
}

/// The running containers in the pods' statuses: pod UID, container name,
/// runtime ID (without its scheme).
fn running_container_ids(store: &crate::pod::PodStore) -> Vec<(String, String, String)> {
    store.read(|pods| {
        pods.iter()
            .flat_map(|(uid, p)| {
                p.status.iter().flat_map(|s| s.container_statuses.iter().flatten()).filter_map(move |c| {
                    let running = c.state.as_ref().is_some_and(|s| s.running.is_some());
                    let id = c.container_id.as_deref()?;
                    let id = id.split_once("://").map_or(id, |(_, raw)| raw);
                    running.then(|| (uid.clone(), c.name.clone(), id.to_owned()))
                })
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A provider without a list is no failure: the relist stays until
    /// shutdown (a supervised task that ends early fails `/healthz`: the
    /// real server's nodes/proxy test found it).
    #[tokio::test(start_paused = true)]
    async fn the_relist_of_a_provider_that_cannot_list_runs_until_shutdown() {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(relist(
            Arc::new(crate::pod::idle_provider::IdleProvider),
            crate::pod::PodStore::default(),
            crate::metrics::PodMetrics::default(),
            shutdown.clone(),
        ));
        tokio::time::sleep(crate::metrics::RELIST_PERIOD * 3).await;
        assert!(!task.is_finished(), "the relist ended before shutdown");
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task).await.expect("ended at shutdown").expect("no panic");
    }
}
