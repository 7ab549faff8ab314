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

use tokio::time::Instant;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, Preconditions};
use kube::runtime::watcher;
use serde_json::Value;
use tokio::sync::Notify;

use super::rate_limit::RateLimiter;
use super::{is_code, status_patch};
use crate::pod::{PodSource, Pods};
use crate::retry::RetryBackoff;

/// How soon a static pod whose mirror pod's name is taken looks again
/// (doubling up to [`BLOCKED_RECHECK_MAX`]).
const BLOCKED_RECHECK: Duration = Duration::from_secs(2);
const BLOCKED_RECHECK_MAX: Duration = Duration::from_secs(30);

/// The field manager of every write the node makes.
pub(crate) const FIELD_MANAGER: &str = "rustlet";

/// The annotation that marks a mirror pod (its value: the static pod's
/// config hash).
pub(crate) const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";
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
    /// Writes a second at most, on average (`--kube-api-qps`; 0: no limit).
    pub api_qps: f64,
    /// Writes at once at most before `api_qps` applies (`--kube-api-burst`).
    pub api_burst: u32,
    /// Writes in flight at most.
    pub parallel_writes: usize,
    /// The status writes' metrics (clones share their values; the node
    /// registers them on its `/metrics`).
    pub metrics: PodSyncMetrics,
}

/// Labels of a failed status write: the API's HTTP status code, or
/// `transport` when no answer came.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct WriteErrorLabels {
    code: String,
}

/// Metrics of the pod status writes.
#[derive(Clone, Debug, Default)]
pub struct PodSyncMetrics {
    writes: prometheus_client::metrics::counter::Counter,
    errors: prometheus_client::metrics::family::Family<WriteErrorLabels, prometheus_client::metrics::counter::Counter>,
    refused: prometheus_client::metrics::counter::Counter,
}

impl PodSyncMetrics {
    /// Registers `rustlet_pod_status_writes_total`,
    /// `rustlet_pod_status_write_errors_total{code}` and
    /// `rustlet_pod_status_writes_refused_total` (403 and 422: the API
    /// refused the write itself; each such pod is retried with backoff).
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "rustlet_pod_status_writes_total",
            "Pod status patches the API accepted",
            self.writes.clone(),
        );
        registry.register(
            "rustlet_pod_status_write_errors_total",
            "Failed pod writes (status patches, mirror pods, deletions) by HTTP status code; each is retried",
            self.errors.clone(),
        );
        registry.register(
            "rustlet_pod_status_writes_refused_total",
            "Pod writes the API refused (403 Forbidden, 422 Invalid); each pod is retried with backoff",
            self.refused.clone(),
        );
    }

    /// Status patches the API accepted so far.
    pub fn writes(&self) -> u64 {
        self.writes.get()
    }

    /// Writes the API refused (403, 422) so far.
    pub fn refused(&self) -> u64 {
        self.refused.get()
    }

    fn failed(&self, error: &kube::Error) {
        let code = match error {
            kube::Error::Api(status) => status.code.to_string(),
            _ => "transport".to_owned(),
        };
        if code == "403" || code == "422" {
            self.refused.inc();
        }
        self.errors.get_or_create(&WriteErrorLabels { code }).inc();
    }
}

impl PodSyncConfig {
    /// Defaults for node `node_name`.
    pub fn new(node_name: &str) -> PodSyncConfig {
        PodSyncConfig {
            node_name: node_name.to_owned(),
            coalesce: Duration::from_millis(20),
            retry_initial: Duration::from_millis(200),
            retry_max: Duration::from_secs(10),
            api_qps: super::rate_limit::DEFAULT_QPS,
            api_burst: super::rate_limit::DEFAULT_BURST,
            parallel_writes: 16,
            metrics: PodSyncMetrics::default(),
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
    /// Of those, writes the API refused (403, 422).
    pub rejected: AtomicU64,
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
    /// The API object as the API last returned it (from the watch or a
    /// write's answer): what status patches are computed against.
    api: Option<ApiView>,
    /// For a static pod: its mirror pod (config hash, whether it exists).
    mirror: Option<Mirror>,
    /// After a failed write: not before this instant, and the backoff.
    retry: Option<(Instant, RetryBackoff)>,
    /// The lifecycle released the pod and its last status went out: what
    /// is left is to finish its deletion.
    last_written: bool,
}

impl Known {
    fn new(pod: &Pod, mirror: Option<Mirror>) -> Known {
        Known {
            namespace: pod.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            name: pod.metadata.name.clone().unwrap_or_default(),
            deleting: false,
            api: None,
            mirror,
            retry: None,
            last_written: false,
        }
    }

    /// Records the API object `pod` unless what is known is newer.
    fn saw(&mut self, pod: &Pod) {
        let newer = match (&self.api, resource_version(pod)) {
            (Some(known), Some(seen)) => known.resource_version.is_none_or(|known| seen >= known),
            _ => true,
        };
        if newer {
            self.api = Some(ApiView {
                uid: pod.metadata.uid.clone().unwrap_or_default(),
                resource_version: resource_version(pod),
                status: pod.status.clone(),
            });
        }
    }
}

/// A resourceVersion as a number (etcd's revision), to tell which of two
/// copies of an object is newer; `None` if it is not a number.
fn resource_version(pod: &Pod) -> Option<u64> {
    pod.metadata.resource_version.as_deref()?.parse().ok()
}

/// The API's copy of a pod, as far as status writes need it.
#[derive(Debug, Clone)]
struct ApiView {
    uid: String,
    resource_version: Option<u64>,
    status: Option<PodStatus>,
}

#[derive(Debug, Clone)]
struct Mirror {
    hash: String,
    exists: bool,
    /// A pod of the mirror pod's name that is not a mirror pod is in the
    /// way (checked again after a relist).
    blocked: bool,
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
pub fn start(
    client: kube::Client,
    config: PodSyncConfig,
    pods: Pods,
    supervision: impl Into<super::Supervision>,
) -> PodSync {
    let supervision = supervision.into();
    let stats = Arc::new(PodSyncStats::default());
    let table: Table = Arc::default();
    let poke = Arc::new(Notify::new());
    let (node, source_client, source_pods, source_table, source_poke) =
        (config.node_name.clone(), client.clone(), pods.clone(), table.clone(), poke.clone());
    supervision.spawn("cluster-pod-watch", move || {
        follow_pods(source_client.clone(), node.clone(), source_pods.clone(), source_table.clone(), source_poke.clone())
    });
    let writer_stats = stats.clone();
    supervision.spawn("cluster-pod-status", move || {
        send_statuses(client.clone(), config.clone(), pods.clone(), table.clone(), writer_stats.clone(), poke.clone())
    });
    PodSync { stats }
}

fn lock(table: &Table) -> std::sync::MutexGuard<'_, HashMap<String, Known>> {
    table.lock().unwrap_or_else(|p| p.into_inner())
}

/// Feeds the lifecycle from the watch.
async fn follow_pods(client: kube::Client, node: String, pods: Pods, table: Table, poke: Arc<Notify>) {
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = crate::mirror::watch_events(api, config, "pods", crate::mirror::Noise::Warn);
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(event) = events.next().await {
        match event {
            watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)
                if is_mirror(&pod) && pod.metadata.deletion_timestamp.is_some() =>
            {
                // Someone is deleting a mirror pod: finish it, then create it again.
                mirror_gone(&table, &pod);
                poke.notify_one();
            }
            watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => {
                if let Some(uid) = pod.metadata.uid.clone() {
                    listed.insert(uid);
                }
                take(&pods, &table, pod);
            }
            watcher::Event::Delete(pod) if is_mirror(&pod) => {
                // Someone deleted a mirror pod: it is created again.
                mirror_gone(&table, &pod);
                poke.notify_one();
            }
            watcher::Event::Delete(pod) => {
                gone(&pods, &table, pod.metadata.uid.as_deref().unwrap_or_default());
                // It may have stood in the way of a mirror pod.
                mirror_gone(&table, &pod);
                poke.notify_one();
            }
            watcher::Event::Init => listed.clear(),
            watcher::Event::InitDone => {
                // Every pod bound to the node is applied: the API source
                // is ready (what unknown pods left may be cleaned up).
                pods.sources().listed(PodSource::Api);
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
                        mirror.blocked = false;
                    }
                }
                poke.notify_one();
            }
        }
    }
}

/// A pod seen in the API: run it, update it, or stop it if it is marked
/// for deletion.
fn take(pods: &Pods, table: &Table, pod: Pod) {
    let Some(uid) = pod.metadata.uid.clone() else { return };
    // A mirror pod stands for a static pod the node already runs: only its
    // API copy is of interest (its status is the static pod's).
    if is_mirror(&pod) {
        let (namespace, name) = (pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref());
        for known in lock(table).values_mut() {
            if known.mirror.is_some()
                && Some(known.namespace.as_str()) == namespace
                && Some(known.name.as_str()) == name
            {
                known.saw(&pod);
            }
        }
        return;
    }
    let deleting = pod.metadata.deletion_timestamp.is_some();
    {
        let mut table = lock(table);
        let known = table.entry(uid.clone()).or_insert_with(|| Known::new(&pod, None));
        known.saw(&pod);
        if known.deleting && !deleting {
            return;
        }
        known.deleting = deleting;
    }
    if deleting {
        // Again when the API shortens the grace period of a deletion under way.
        tracing::info!(
            pod.uid = %uid,
            pod = ?pod.metadata.name,
            grace_seconds = ?pod.metadata.deletion_grace_period_seconds,
            "pod marked for deletion; stopping it"
        );
        pods.remove(pod);
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
            tracing::info!(pod = %known.name, "mirror pod (or a pod in its way) deleted; creating it again");
            mirror.exists = false;
            mirror.blocked = false;
            known.api = None;
            known.retry = None;
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
            table
                .entry(uid.clone())
                .or_insert_with(|| Known::new(pod, Some(Mirror { hash, exists: false, blocked: false })));
        }
        for (uid, known) in table.iter_mut() {
            if known.mirror.is_some() && !local.contains_key(uid) {
                known.deleting = true;
            }
        }
    });
}

/// The mirror pod of static pod `pod`: owned by the Node (`node_uid`), as
/// NodeRestriction requires of every pod a node creates.
fn mirror_of(pod: &Pod, hash: &str, node: &str, node_uid: &str) -> Pod {
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
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.to_owned(),
                uid: node_uid.to_owned(),
                controller: Some(true),
                block_owner_deletion: None,
            }]),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    }
}

/// What became of a static pod's mirror pod.
enum MirrorOutcome {
    /// It exists (created, adopted or replaced).
    Exists,
    /// A pod of that name that is not a mirror pod is in the way: it is
    /// the user's, and is left alone.
    Blocked,
}

/// Makes sure the mirror pod of static pod `uid` exists: creates it, or
/// adopts one of the same hash (a mirror pod of another hash, or one being
/// deleted, is deleted first). A pod of that name that is not a mirror pod
/// is someone else's: it is reported and left alone.
async fn ensure_mirror(
    client: &kube::Client,
    api: &Api<Pod>,
    pods: &Pods,
    uid: &str,
    known: &Known,
    node: &str,
) -> Result<MirrorOutcome, kube::Error> {
    let (Some(mirror), Some(local)) = (known.mirror.as_ref(), pods.store().get(uid)) else {
        return Ok(MirrorOutcome::Exists);
    };
    let node_uid = Api::<Node>::all(client.clone()).get(node).await?.metadata.uid.unwrap_or_default();
    let object = mirror_of(&local, &mirror.hash, node, &node_uid);
    match api.create(&super::post_params(), &object).await {
        Ok(_) => {
            tracing::info!(pod = %known.name, "mirror pod created");
            Ok(MirrorOutcome::Exists)
        }
        Err(error) if is_code(&error, 409) => {
            let existing = match api.get_opt(&known.name).await {
                Ok(Some(existing)) => Some(existing),
                // Gone meanwhile: the next pass creates it.
                Ok(None) => return Err(error),
                // The node authorizer (1.32+, `AuthorizeNodeWithSelectors`)
                // lets a node read only the pods bound to it: one it may
                // not read is not this node's mirror pod.
                Err(forbidden) if is_code(&forbidden, 403) => None,
                Err(other) => return Err(other),
            };
            let Some(existing) = existing.filter(is_mirror) else {
                if !mirror.blocked {
                    tracing::warn!(
                        pod = %known.name,
                        namespace = %known.namespace,
                        "a pod that is not a mirror pod has the static pod's name: it is left alone and the static pod has no mirror pod while it exists"
                    );
                }
                return Ok(MirrorOutcome::Blocked);
            };
            let hash = existing.metadata.annotations.as_ref().and_then(|a| a.get(MIRROR_ANNOTATION));
            if hash == Some(&mirror.hash) && existing.metadata.deletion_timestamp.is_none() {
                tracing::info!(pod = %known.name, "mirror pod from an earlier run adopted");
                return Ok(MirrorOutcome::Exists);
            }
            // A mirror pod of another hash, or being deleted: replace it.
            let params = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions { uid: existing.metadata.uid.clone(), resource_version: None }),
                ..DeleteParams::default()
            };
            api.delete(&known.name, &params).await?;
            api.create(&super::post_params(), &object).await?;
            tracing::info!(pod = %known.name, "stale mirror pod replaced");
            Ok(MirrorOutcome::Exists)
        }
        Err(error) => Err(error),
    }
}

/// The pod is gone from the API: stop it; nothing is sent back.
fn gone(pods: &Pods, table: &Table, uid: &str) {
    if lock(table).remove(uid).is_some() {
        tracing::info!(pod.uid = %uid, "pod removed from the API; stopping it at once");
        pods.remove_now(uid);
    }
}

/// Sends statuses and final deletions as the pod store changes: every pod
/// that needs a write gets one, in parallel under the client-side rate
/// limit; a pod whose write fails waits out its own backoff without
/// holding back the others.
async fn send_statuses(
    client: kube::Client,
    config: PodSyncConfig,
    pods: Pods,
    table: Table,
    stats: Arc<PodSyncStats>,
    poke: Arc<Notify>,
) {
    let mut changes = pods.store().changes();
    let limiter = Arc::new(RateLimiter::new(config.api_qps, config.api_burst));
    let writer = Writer { client, config, pods, table, stats, limiter };
    loop {
        changes.borrow_and_update();
        follow_static(&writer.pods, &writer.table);
        let next_retry = writer.sync_once().await;
        let retry = async {
            match next_retry {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            () = writer_poked(&poke) => {}
            () = retry => {}
        }
        // Let changes that come together make one write per pod.
        tokio::time::sleep(writer.config.coalesce).await;
    }
}

/// The status patch that brings the API's view of `known` to `local`'s
/// status, if they differ.
fn status_write(local: Pod, known: &Known) -> Option<Write> {
    let view = known.api.as_ref()?;
    let gates: Vec<String> = local
        .spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_ref())
        .map(|gates| gates.iter().map(|g| g.condition_type.clone()).collect())
        .unwrap_or_default();
    let desired = status_patch::desired(local.status.unwrap_or_default(), view.status.as_ref(), &gates);
    status_patch::patch(&view.uid, view.status.as_ref(), &desired).map(Write::Status)
}

async fn writer_poked(poke: &Notify) {
    poke.notified().await;
}

/// What one pass writes for one pod.
enum Write {
    /// Create or adopt the static pod's mirror pod.
    Mirror,
    /// Delete the mirror pod of a static pod that is gone.
    DeleteMirror,
    /// Patch the status.
    Status(Value),
    /// Patch the status of a pod the lifecycle released: its last one,
    /// written before its deletion is finished.
    LastStatus(Value),
    /// Delete the pod for good (grace 0, UID precondition): the lifecycle
    /// released it after the API asked for its deletion.
    Finish,
}

/// Why a write did not happen.
enum WriteError {
    /// The pod is gone (or replaced by a pod of the same name): forget it.
    Gone,
    /// The API lost the pod while the node still runs (or stops) it: a
    /// status write found it deleted before the watch said so. Stop it at
    /// once, as when the watch reports it gone: the watch's word will find
    /// it forgotten already.
    Vanished,
    /// Someone else's pod holds the mirror pod's name: look again later
    /// (that pod may be bound to another node, where no watch of this
    /// node's pods sees it go).
    Blocked,
    /// Try again after a backoff.
    Retry(kube::Error),
}

/// The status manager's writer: the one place pod writes go out.
struct Writer {
    client: kube::Client,
    config: PodSyncConfig,
    pods: Pods,
    table: Table,
    stats: Arc<PodSyncStats>,
    limiter: Arc<RateLimiter>,
}

impl Writer {
    /// One pass: every pod that needs a write (and is not waiting out a
    /// backoff) gets it. Returns when the earliest backoff ends, if any.
    async fn sync_once(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut jobs = Vec::new();
        let mut next_retry: Option<Instant> = None;
        {
            let table = lock(&self.table);
            for (uid, known) in table.iter() {
                if let Some((at, _)) = &known.retry
                    && *at > now
                {
                    next_retry = Some(next_retry.map_or(*at, |n| n.min(*at)));
                    continue;
                }
                if let Some(write) = self.needed(uid, known) {
                    jobs.push((uid.clone(), known.clone(), write));
                }
            }
        }
        let results: Vec<(String, bool, Result<Option<Pod>, WriteError>)> = futures_util::stream::iter(jobs)
            .map(|(uid, known, write)| async move {
                self.limiter.acquire().await;
                let last = matches!(write, Write::LastStatus(_));
                let result = self.write(&uid, &known, write).await;
                (uid, last, result)
            })
            .buffer_unordered(self.config.parallel_writes.max(1))
            .collect()
            .await;
        let mut table = lock(&self.table);
        for (uid, last, result) in results {
            match result {
                Ok(answer) => {
                    if let Some(known) = table.get_mut(&uid) {
                        known.retry = None;
                        if let Some(pod) = answer {
                            known.saw(&pod);
                        }
                        // A released pod's last status went out: its
                        // deletion is finished in the next pass, which
                        // nothing else would start.
                        if last {
                            known.last_written = true;
                            next_retry = Some(Instant::now());
                        }
                    }
                }
                Err(WriteError::Gone) => {
                    table.remove(&uid);
                    self.pods.store().forget_last(&uid);
                }
                Err(WriteError::Vanished) => {
                    table.remove(&uid);
                    self.pods.store().forget_last(&uid);
                    tracing::info!(pod.uid = %uid, "pod no longer in the API; stopping it at once");
                    self.pods.remove_now(&uid);
                }
                Err(WriteError::Blocked) => {
                    let Some(known) = table.get_mut(&uid) else { continue };
                    let mut backoff = known
                        .retry
                        .take()
                        .map_or_else(|| RetryBackoff::new(BLOCKED_RECHECK, BLOCKED_RECHECK_MAX), |(_, b)| b);
                    let at = Instant::now() + backoff.next_delay();
                    known.retry = Some((at, backoff));
                    next_retry = Some(next_retry.map_or(at, |n| n.min(at)));
                }
                Err(WriteError::Retry(error)) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    self.config.metrics.failed(&error);
                    if super::is_code(&error, 403) || super::is_code(&error, 422) {
                        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                    }
                    let Some(known) = table.get_mut(&uid) else { continue };
                    let mut backoff = known.retry.take().map_or_else(
                        || RetryBackoff::new(self.config.retry_initial, self.config.retry_max),
                        |(_, b)| b,
                    );
                    let delay = backoff.next_delay();
                    tracing::warn!(
                        pod.uid = %uid,
                        pod = %known.name,
                        error = %super::describe(&error),
                        retry_in = ?delay,
                        "pod write failed; retrying this pod"
                    );
                    let at = Instant::now() + delay;
                    known.retry = Some((at, backoff));
                    next_retry = Some(next_retry.map_or(at, |n| n.min(at)));
                }
            }
        }
        next_retry
    }

    /// The write pod `uid` needs now, if any.
    fn needed(&self, uid: &str, known: &Known) -> Option<Write> {
        if let Some(mirror) = &known.mirror {
            if known.deleting {
                return Some(Write::DeleteMirror);
            }
            if !mirror.exists || mirror.blocked {
                return Some(Write::Mirror);
            }
        }
        let Some(local) = self.pods.store().get(uid) else {
            // Released by the lifecycle, or (deleted while the node was
            // down) by the release of what an earlier run left behind. The
            // pod's last status goes out first (the lifecycle may have
            // released it between two passes): the deletion carries how
            // the pod ended, never a stale "running".
            if known.mirror.is_none()
                && !known.last_written
                && let Some(last) = self.pods.store().last_of(uid)
                && let Some(Write::Status(patch)) = status_write(last, known)
            {
                return Some(Write::LastStatus(patch));
            }
            let finish = known.deleting && known.mirror.is_none() && self.pods.released(uid);
            return finish.then_some(Write::Finish);
        };
        status_write(local, known)
    }

    async fn write(&self, uid: &str, known: &Known, write: Write) -> Result<Option<Pod>, WriteError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &known.namespace);
        let node = &self.config.node_name;
        let params = super::patch_params();
        match write {
            Write::Mirror => {
                let outcome =
                    ensure_mirror(&self.client, &api, &self.pods, uid, known, node).await.map_err(WriteError::Retry)?;
                let mut table = lock(&self.table);
                let Some(Known { mirror: Some(mirror), .. }) = table.get_mut(uid) else { return Ok(None) };
                match outcome {
                    MirrorOutcome::Exists => {
                        mirror.exists = true;
                        mirror.blocked = false;
                        self.stats.mirror_pods.fetch_add(1, Ordering::Relaxed);
                        Ok(None)
                    }
                    MirrorOutcome::Blocked => {
                        mirror.blocked = true;
                        Err(WriteError::Blocked)
                    }
                }
            }
            Write::DeleteMirror => {
                let params = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
                match api.delete(&known.name, &params).await {
                    Ok(_) => tracing::info!(pod = %known.name, "mirror pod deleted with its static pod"),
                    Err(error) if is_code(&error, 404) => {}
                    Err(error) => return Err(WriteError::Retry(error)),
                }
                Err(WriteError::Gone)
            }
            Write::Status(patch) | Write::LastStatus(patch) => {
                match api.patch_status(&known.name, &params, &Patch::Strategic(&patch)).await {
                    Ok(pod) => {
                        self.stats.status_patches.fetch_add(1, Ordering::Relaxed);
                        self.config.metrics.writes.inc();
                        Ok(Some(pod))
                    }
                    // Gone, or another pod of that name now.
                    Err(error) if is_code(&error, 404) || is_code(&error, 409) && known.mirror.is_none() => {
                        if known.mirror.is_some() {
                            // A static pod's mirror: the static pod runs on.
                            Err(WriteError::Gone)
                        } else if known.deleting || is_code(&error, 404) {
                            Err(WriteError::Vanished)
                        } else {
                            Err(WriteError::Retry(error))
                        }
                    }
                    Err(error) => Err(WriteError::Retry(error)),
                }
            }
            Write::Finish => {
                let params = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions { uid: Some(uid.to_owned()), resource_version: None }),
                    ..DeleteParams::default()
                };
                match api.delete(&known.name, &params).await {
                    Ok(_) => {
                        self.stats.deletions.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(pod.uid = %uid, pod = %known.name, "pod released and deleted");
                        Err(WriteError::Gone)
                    }
                    Err(error) if is_code(&error, 404) || is_code(&error, 409) => Err(WriteError::Gone),
                    Err(error) => Err(WriteError::Retry(error)),
                }
            }
        }
    }
}
