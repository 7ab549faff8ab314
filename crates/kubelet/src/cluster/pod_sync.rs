//! Pods from the API: one watch on the pods bound to this node
//! (`spec.nodeName=<node>`; kube-runtime's watcher resumes it from its
//! resourceVersion and relists after a 410) feeds the lifecycle; the
//! statuses the lifecycle computes go back as status patches; a pod the API
//! marks for deletion is stopped within its grace period, released, then
//! deleted with grace period 0 and a precondition on its UID, as the
//! kubelet does.
//!
//! Status patches are driven by the pod store's change signal (no poll):
//! each pod's status is sent when it differs from the last one sent, and a
//! failed patch is retried with backoff and counted.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::pod::Pods;

/// The annotation that marks a mirror pod (its value: the static pod's
/// config hash).
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// Settings of the pod sync.
#[derive(Debug, Clone)]
pub struct PodSyncConfig {
    /// The node's name (`spec.nodeName` of its pods).
    pub node_name: String,
    /// How long status changes are gathered before they are sent.
    pub coalesce: Duration,
    /// The first retry delay after a failed call (doubling up to `retry_max`).
    pub retry_initial: Duration,
    /// The longest retry delay.
    pub retry_max: Duration,
}

impl PodSyncConfig {
    /// Defaults for node `node_name`.
    pub fn new(node_name: &str) -> PodSyncConfig {
        PodSyncConfig {
            node_name: node_name.to_owned(),
            coalesce: Duration::from_millis(20),
            retry_initial: Duration::from_millis(200),
            retry_max: Duration::from_secs(10),
        }
    }
}

/// Counters of what the sync did.
#[derive(Debug, Default)]
pub struct PodSyncStats {
    /// Status patches that succeeded.
    pub status_patches: AtomicU64,
    /// Final deletions (grace period 0) that succeeded.
    pub deletions: AtomicU64,
    /// API calls that failed (and were retried).
    pub failures: AtomicU64,
}

/// What the sync knows of one API pod.
#[derive(Debug, Clone)]
struct Known {
    namespace: String,
    name: String,
    /// The API marked it for deletion (or it is gone from the API).
    deleting: bool,
    /// The last status sent.
    sent: Option<PodStatus>,
}

/// A running pod sync.
#[derive(Debug, Clone)]
pub struct PodSync {
    stats: Arc<PodSyncStats>,
}

impl PodSync {
    /// What it did so far.
    pub fn stats(&self) -> &PodSyncStats {
        &self.stats
    }
}

type Table = Arc<Mutex<HashMap<String, Known>>>;

/// Starts running the pods the API binds to this node.
pub fn start(client: kube::Client, config: PodSyncConfig, pods: Pods, shutdown: CancellationToken) -> PodSync {
    let stats = Arc::new(PodSyncStats::default());
    let table: Table = Arc::default();
    let source = follow_pods(client.clone(), config.node_name.clone(), pods.clone(), table.clone());
    let status = send_statuses(client, config, pods, table, stats.clone());
    tokio::spawn(until(shutdown.clone(), source));
    tokio::spawn(until(shutdown, status));
    PodSync { stats }
}

async fn until(shutdown: CancellationToken, work: impl std::future::Future<Output = ()>) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = work => {}
    }
}

fn lock(table: &Table) -> std::sync::MutexGuard<'_, HashMap<String, Known>> {
    table.lock().unwrap_or_else(|p| p.into_inner())
}

/// Feeds the lifecycle from the watch.
async fn follow_pods(client: kube::Client, node: String, pods: Pods, table: Table) {
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = watcher(api, config).boxed();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                if let Some(uid) = pod.metadata.uid.clone() {
                    listed.insert(uid);
                }
                take(&pods, &table, pod);
            }
            Ok(watcher::Event::Delete(pod)) => gone(&pods, &table, pod.metadata.uid.as_deref().unwrap_or_default()),
            Ok(watcher::Event::Init) => listed.clear(),
            Ok(watcher::Event::InitDone) => {
                // Pods deleted while the watch was down.
                let missing: Vec<String> =
                    lock(&table).iter().filter(|(uid, _)| !listed.contains(*uid)).map(|(uid, _)| uid.clone()).collect();
                for uid in missing {
                    gone(&pods, &table, &uid);
                }
            }
            Err(error) => {
                tracing::warn!(%error, "pod watch failed; resuming");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// A pod seen in the API: run it, update it, or stop it if it is marked
/// for deletion.
fn take(pods: &Pods, table: &Table, pod: Pod) {
    let Some(uid) = pod.metadata.uid.clone() else { return };
    // A mirror pod stands for a static pod the node already runs.
    if pod.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(MIRROR_ANNOTATION)) {
        return;
    }
    let deleting = pod.metadata.deletion_timestamp.is_some();
    {
        let mut table = lock(table);
        let known = table.entry(uid.clone()).or_insert_with(|| Known {
            namespace: pod.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            name: pod.metadata.name.clone().unwrap_or_default(),
            deleting: false,
            sent: None,
        });
        if known.deleting {
            return;
        }
        known.deleting = deleting;
    }
    if deleting {
        tracing::info!(pod.uid = %uid, pod = ?pod.metadata.name, "pod marked for deletion; stopping it");
        pods.delete(&uid);
    } else {
        pods.apply(pod);
    }
}

/// The pod is gone from the API: stop it; nothing is sent back.
fn gone(pods: &Pods, table: &Table, uid: &str) {
    if lock(table).remove(uid).is_some() {
        tracing::info!(pod.uid = %uid, "pod removed from the API; stopping it");
        pods.delete(uid);
    }
}

/// Sends statuses and final deletions as the pod store changes.
async fn send_statuses(
    client: kube::Client,
    config: PodSyncConfig,
    pods: Pods,
    table: Table,
    stats: Arc<PodSyncStats>,
) {
    let mut changes = pods.store().changes();
    let mut delay = config.retry_initial;
    loop {
        changes.borrow_and_update();
        let all_sent = sync_once(&client, &pods, &table, &stats).await;
        if all_sent {
            delay = config.retry_initial;
            if changes.changed().await.is_err() {
                return;
            }
            // Let changes that come together make one patch per pod.
            tokio::time::sleep(config.coalesce).await;
        } else {
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                // The node is stopping.
                changed = changes.changed() => if changed.is_err() { return },
            }
            delay = (delay * 2).min(config.retry_max);
        }
    }
}

/// One pass over the API pods; returns whether every call succeeded.
async fn sync_once(client: &kube::Client, pods: &Pods, table: &Table, stats: &PodSyncStats) -> bool {
    let snapshot: Vec<(String, Known)> = lock(table).iter().map(|(uid, k)| (uid.clone(), k.clone())).collect();
    let mut ok = true;
    for (uid, known) in snapshot {
        let api: Api<Pod> = Api::namespaced(client.clone(), &known.namespace);
        let local = pods.store().get(&uid);
        let result = match local {
            Some(local) => {
                let status = local.status.unwrap_or_default();
                if known.sent.as_ref() == Some(&status) {
                    continue;
                }
                let patch = json!({"status": status});
                match api.patch_status(&known.name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                    Ok(_) => {
                        stats.status_patches.fetch_add(1, Ordering::Relaxed);
                        if let Some(k) = lock(table).get_mut(&uid) {
                            k.sent = Some(status);
                        }
                        Ok(())
                    }
                    Err(error) => Err(error),
                }
            }
            // Released by the lifecycle after the API asked for deletion:
            // delete it for good, only if it is still the same pod.
            None if known.deleting => {
                let params = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions { uid: Some(uid.clone()), resource_version: None }),
                    ..DeleteParams::default()
                };
                match api.delete(&known.name, &params).await {
                    Ok(_) => {
                        stats.deletions.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(pod.uid = %uid, pod = %known.name, "pod released and deleted");
                        lock(table).remove(&uid);
                        Ok(())
                    }
                    Err(error) => Err(error),
                }
            }
            None => continue,
        };
        if let Err(error) = result {
            match &error {
                // Gone, or another pod of that name now: nothing more to do for this one.
                kube::Error::Api(status) if status.code == 404 || status.code == 409 && known.deleting => {
                    lock(table).remove(&uid);
                }
                _ => {
                    stats.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pod.uid = %uid, pod = %known.name, %error, "pod status or deletion failed; retrying");
                    ok = false;
                }
            }
        }
    }
    ok
}
