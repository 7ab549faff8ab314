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
//!
//! Static pods (from the manifest directory) get mirror pods, as upstream:
//! an API pod of the same name, namespace, labels and spec, bound to the
//! node, annotated `kubernetes.io/config.mirror: <config hash>`; the static
//! pod's status is patched onto it. A mirror pod deleted by someone else is
//! created again; one left from an earlier run with the same hash is
//! adopted (another hash: replaced); the mirror pod is deleted when its
//! static pod goes. Mirror pods from the watch are never run (the node runs
//! the static pod itself).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::watcher;
use serde_json::json;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::is_code;
use crate::pod::Pods;

/// The annotation that marks a mirror pod (its value: the static pod's
/// config hash).
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";
const CONFIG_SOURCE: &str = "kubernetes.io/config.source";
const CONFIG_HASH: &str = "kubernetes.io/config.hash";

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
    /// Mirror pods created or adopted.
    pub mirror_pods: AtomicU64,
}

/// What the sync knows of one API pod (by the UID of the pod the node
/// runs: for a mirror pod, its static pod's UID).
#[derive(Debug, Clone)]
struct Known {
    namespace: String,
    name: String,
    /// The API marked it for deletion (or it is gone from the API); for a
    /// mirror pod: its static pod is gone.
    deleting: bool,
    /// The last status sent.
    sent: Option<PodStatus>,
    /// For a static pod: its mirror pod (config hash, whether it exists).
    mirror: Option<Mirror>,
}

#[derive(Debug, Clone)]
struct Mirror {
    hash: String,
    exists: bool,
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

/// Starts running the pods the API binds to this node (and mirroring its
/// static pods).
pub fn start(client: kube::Client, config: PodSyncConfig, pods: Pods, shutdown: CancellationToken) -> PodSync {
    let stats = Arc::new(PodSyncStats::default());
    let table: Table = Arc::default();
    let poke = Arc::new(Notify::new());
    let source = follow_pods(client.clone(), config.node_name.clone(), pods.clone(), table.clone(), poke.clone());
    let status = send_statuses(client, config, pods, table, stats.clone(), poke);
    super::spawn_until(&shutdown, source);
    super::spawn_until(&shutdown, status);
    PodSync { stats }
}

fn lock(table: &Table) -> std::sync::MutexGuard<'_, HashMap<String, Known>> {
    table.lock().unwrap_or_else(|p| p.into_inner())
}

/// Feeds the lifecycle from the watch.
async fn follow_pods(client: kube::Client, node: String, pods: Pods, table: Table, poke: Arc<Notify>) {
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = watcher(api, config).boxed();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod))
                if is_mirror(&pod) && pod.metadata.deletion_timestamp.is_some() =>
            {
                // Someone is deleting a mirror pod: finish it, then create it again.
                mirror_gone(&table, &pod);
                poke.notify_one();
            }
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                if let Some(uid) = pod.metadata.uid.clone() {
                    listed.insert(uid);
                }
                take(&pods, &table, pod);
            }
            Ok(watcher::Event::Delete(pod)) if is_mirror(&pod) => {
                // Someone deleted a mirror pod: it is created again.
                mirror_gone(&table, &pod);
                poke.notify_one();
            }
            Ok(watcher::Event::Delete(pod)) => gone(&pods, &table, pod.metadata.uid.as_deref().unwrap_or_default()),
            Ok(watcher::Event::Init) => listed.clear(),
            Ok(watcher::Event::InitDone) => {
                // Pods deleted while the watch was down.
                let missing: Vec<String> = lock(&table)
                    .iter()
                    .filter(|(uid, known)| known.mirror.is_none() && !listed.contains(*uid))
                    .map(|(uid, _)| uid.clone())
                    .collect();
                for uid in missing {
                    gone(&pods, &table, &uid);
                }
                // Mirror pods may have gone while the watch was down: check
                // (create, or adopt what is there) again.
                for known in lock(&table).values_mut() {
                    if let Some(mirror) = known.mirror.as_mut() {
                        mirror.exists = false;
                    }
                }
                poke.notify_one();
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
    if is_mirror(&pod) {
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
            mirror: None,
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

fn is_mirror(pod: &Pod) -> bool {
    pod.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(MIRROR_ANNOTATION))
}

/// The static pod's config hash, if `pod` is a static pod.
fn static_hash(pod: &Pod) -> Option<String> {
    let annotations = pod.metadata.annotations.as_ref()?;
    if annotations.get(CONFIG_SOURCE).map(String::as_str) != Some("file") {
        return None;
    }
    annotations.get(CONFIG_HASH).cloned()
}

/// A mirror pod left the API: its static pod needs a new one.
fn mirror_gone(table: &Table, pod: &Pod) {
    let (namespace, name) = (pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref());
    for known in lock(table).values_mut() {
        let here = Some(known.namespace.as_str()) == namespace && Some(known.name.as_str()) == name;
        if here && let Some(mirror) = known.mirror.as_mut().filter(|_| !known.deleting) {
            tracing::info!(pod = %known.name, "mirror pod deleted; creating it again");
            mirror.exists = false;
            known.sent = None;
        }
    }
}

/// Static pods the table does not know yet get a mirror entry; entries
/// whose static pod is gone are marked for deletion.
fn follow_static(pods: &Pods, table: &Table) {
    let mut table = lock(table);
    pods.store().read(|local| {
        for (uid, pod) in local {
            let Some(hash) = static_hash(pod).filter(|_| pod.metadata.deletion_timestamp.is_none()) else { continue };
            table.entry(uid.clone()).or_insert_with(|| Known {
                namespace: pod.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                name: pod.metadata.name.clone().unwrap_or_default(),
                deleting: false,
                sent: None,
                mirror: Some(Mirror { hash, exists: false }),
            });
        }
        for (uid, known) in table.iter_mut() {
            if known.mirror.is_some() && !local.contains_key(uid) {
                known.deleting = true;
            }
        }
    });
}

/// The mirror pod of static pod `pod`.
fn mirror_of(pod: &Pod, hash: &str, node: &str) -> Pod {
    let mut annotations = pod.metadata.annotations.clone().unwrap_or_default();
    annotations.insert(MIRROR_ANNOTATION.to_owned(), hash.to_owned());
    let mut spec = pod.spec.clone();
    if let Some(spec) = spec.as_mut() {
        spec.node_name = Some(node.to_owned());
    }
    Pod {
        metadata: ObjectMeta {
            name: pod.metadata.name.clone(),
            namespace: pod.metadata.namespace.clone(),
            labels: pod.metadata.labels.clone(),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    }
}

/// Makes sure the mirror pod of static pod `uid` exists: creates it, or
/// adopts one of the same hash (one of another hash is deleted first).
async fn ensure_mirror(api: &Api<Pod>, pods: &Pods, uid: &str, known: &Known, node: &str) -> Result<(), kube::Error> {
    let (Some(mirror), Some(local)) = (known.mirror.as_ref(), pods.store().get(uid)) else { return Ok(()) };
    let object = mirror_of(&local, &mirror.hash, node);
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => {
            tracing::info!(pod = %known.name, "mirror pod created");
            Ok(())
        }
        Err(error) if is_code(&error, 409) => {
            let Some(existing) = api.get_opt(&known.name).await? else {
                // Gone meanwhile: the next pass creates it.
                return Err(error);
            };
            let hash = existing.metadata.annotations.as_ref().and_then(|a| a.get(MIRROR_ANNOTATION));
            if hash == Some(&mirror.hash) && existing.metadata.deletion_timestamp.is_none() {
                tracing::info!(pod = %known.name, "mirror pod from an earlier run adopted");
                return Ok(());
            }
            // Being deleted, of another hash, or not a mirror pod: replace it.
            let params = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions { uid: existing.metadata.uid.clone(), resource_version: None }),
                ..DeleteParams::default()
            };
            api.delete(&known.name, &params).await?;
            api.create(&PostParams::default(), &object).await?;
            tracing::info!(pod = %known.name, "stale mirror pod replaced");
            Ok(())
        }
        Err(error) => Err(error),
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
    poke: Arc<Notify>,
) {
    let mut changes = pods.store().changes();
    let mut delay = config.retry_initial;
    loop {
        changes.borrow_and_update();
        follow_static(&pods, &table);
        let all_sent = sync_once(&client, &config.node_name, &pods, &table, &stats).await;
        if all_sent {
            delay = config.retry_initial;
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                () = poke.notified() => {}
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
async fn sync_once(client: &kube::Client, node: &str, pods: &Pods, table: &Table, stats: &PodSyncStats) -> bool {
    let snapshot: Vec<(String, Known)> = lock(table).iter().map(|(uid, k)| (uid.clone(), k.clone())).collect();
    let mut ok = true;
    for (uid, known) in snapshot {
        let api: Api<Pod> = Api::namespaced(client.clone(), &known.namespace);
        let local = pods.store().get(&uid);
        if let Some(mirror) = known.mirror.as_ref().filter(|_| !known.deleting) {
            if !mirror.exists {
                match ensure_mirror(&api, pods, &uid, &known, node).await {
                    Ok(()) => {
                        if let Some(Known { mirror: Some(m), .. }) = lock(table).get_mut(&uid) {
                            m.exists = true;
                        }
                        stats.mirror_pods.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(error) => {
                        stats.failures.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(pod = %known.name, %error, "cannot create the mirror pod; retrying");
                        ok = false;
                        continue;
                    }
                }
            }
        } else if known.mirror.is_some() {
            // The static pod is gone: its mirror pod goes too.
            let params = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
            match api.delete(&known.name, &params).await {
                Ok(_) => tracing::info!(pod = %known.name, "mirror pod deleted with its static pod"),
                Err(error) if is_code(&error, 404) => {}
                Err(error) => {
                    stats.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pod = %known.name, %error, "cannot delete the mirror pod; retrying");
                    ok = false;
                    continue;
                }
            }
            lock(table).remove(&uid);
            continue;
        }
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
