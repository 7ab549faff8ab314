//! The pods the node runs, each with its latest status: what `/pods` lists
//! and what tests and cluster mode wait on.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use tokio::sync::watch;

/// How many removed pods' last states are kept ([`PodStore::last_of`]).
const KEPT_LAST_STATES: usize = 1024;

/// Pods by UID with their latest status; cheap to clone.
#[derive(Clone, Debug)]
pub struct PodStore {
    pods: Arc<Mutex<BTreeMap<String, Pod>>>,
    generation: Arc<watch::Sender<u64>>,
    /// The last state of the pods removed most recently, oldest first: a
    /// status writer that had not written it yet writes it before it
    /// finishes the pod's deletion, as the kubelet's status manager writes
    /// a pod's terminal status before the pod may be deleted.
    removed: Arc<Mutex<std::collections::VecDeque<(String, Pod)>>>,
}

impl Default for PodStore {
    fn default() -> Self {
        PodStore { pods: Arc::default(), generation: Arc::new(watch::channel(0).0), removed: Arc::default() }
    }
}

impl PodStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Pod>> {
        self.pods.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    /// Wakes whoever waits on [`PodStore::changes`] (something they read
    /// besides the pods changed).
    pub(crate) fn touch(&self) {
        self.bump();
    }

    /// Records the pod's spec (keeping its status).
    pub(crate) fn put_spec(&self, uid: &str, pod: &Pod) {
        let mut pods = self.lock();
        let known = pods.get(uid);
        let status = known.and_then(|p| p.status.clone());
        let mut pod = Pod { status, ..pod.clone() };
        if pod.metadata.creation_timestamp.is_none() {
            // The node's first sight of the pod (what `AGE` counts from).
            pod.metadata.creation_timestamp = known
                .and_then(|p| p.metadata.creation_timestamp.clone())
                .or_else(|| Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now())));
        }
        pods.insert(uid.to_owned(), pod);
        drop(pods);
        self.bump();
    }

    /// Records the pod's status.
    pub(crate) fn put_status(&self, uid: &str, status: PodStatus) {
        let mut pods = self.lock();
        if let Some(pod) = pods.get_mut(uid) {
            pod.status = Some(status);
        }
        drop(pods);
        self.bump();
    }

    /// Marks the pod as being removed (`metadata.deletionTimestamp`).
    pub(crate) fn mark_deleting(&self, uid: &str) {
        let mut pods = self.lock();
        if let Some(pod) = pods.get_mut(uid)
            && pod.metadata.deletion_timestamp.is_none()
        {
            pod.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()));
        }
        drop(pods);
        self.bump();
    }

    /// Forgets the pod, keeping its last state for [`PodStore::last_of`].
    pub(crate) fn remove(&self, uid: &str) {
        let last = self.lock().remove(uid);
        if let Some(pod) = last {
            let mut removed = self.removed.lock().unwrap_or_else(|p| p.into_inner());
            removed.retain(|(u, _)| u != uid);
            if removed.len() == KEPT_LAST_STATES {
                removed.pop_front();
            }
            removed.push_back((uid.to_owned(), pod));
        }
        self.bump();
    }

    /// The last state of pod `uid`, removed recently (the last
    /// [`KEPT_LAST_STATES`] removals are kept until [`PodStore::forget_last`]).
    pub fn last_of(&self, uid: &str) -> Option<Pod> {
        let removed = self.removed.lock().unwrap_or_else(|p| p.into_inner());
        removed.iter().rev().find(|(u, _)| u == uid).map(|(_, pod)| pod.clone())
    }

    /// Forgets the last state of pod `uid` (its deletion is finished).
    pub fn forget_last(&self, uid: &str) {
        self.removed.lock().unwrap_or_else(|p| p.into_inner()).retain(|(u, _)| u != uid);
    }

    /// Reads the pods (by UID) in place, without copying them.
    pub fn read<R>(&self, f: impl FnOnce(&BTreeMap<String, Pod>) -> R) -> R {
        f(&self.lock())
    }

    /// The pod with its status.
    pub fn get(&self, uid: &str) -> Option<Pod> {
        self.lock().get(uid).cloned()
    }

    /// Every pod, ordered by namespace and name.
    pub fn list(&self) -> Vec<Pod> {
        let mut pods: Vec<Pod> = self.lock().values().cloned().collect();
        pods.sort_by(|a, b| {
            (a.metadata.namespace.as_deref(), a.metadata.name.as_deref())
                .cmp(&(b.metadata.namespace.as_deref(), b.metadata.name.as_deref()))
        });
        pods
    }

    /// Bumped on every change.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Waits up to `timeout` until `pred` holds for the pods; returns them.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&BTreeMap<String, Pod>) -> bool,
    ) -> Option<BTreeMap<String, Pod>> {
        let mut changes = self.changes();
        let wait = async {
            loop {
                {
                    let pods = self.lock();
                    if pred(&pods) {
                        return Some(pods.clone());
                    }
                }
                if changes.changed().await.is_err() {
                    return None;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.ok().flatten()
    }
}
