//! The resource claims prepared on this node: which pods use each, what
//! its drivers prepared, kept in a checkpoint (`<root-dir>/dra_manager_state`)
//! so that a restarted node neither prepares a claim again nor forgets to
//! release it.
//!
//! A claim is prepared once, by the first pod that needs it (one
//! `NodePrepareResources` per driver for all of that pod's new claims), and
//! released (`NodeUnprepareResources`) when the last pod using it is gone.
//! The pod's reference is written before the driver is called, so a node
//! killed in between releases the claim if the pod is gone when it is back.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Pod;

use super::plugins::{ClaimRef, DraDrivers, PreparedDevice};

/// The checkpoint's file name in the root dir (upstream's name).
pub const DRA_CHECKPOINT_FILE: &str = "dra_manager_state";

const CHECKPOINT_KIND: &str = "DRACheckpoint";
const CHECKPOINT_API_VERSION: &str = "checkpoint.dra.rustlet.dev/v1";

/// A claim of a pod, resolved through the API: what to prepare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedClaim {
    /// The claim.
    pub claim: ClaimRef,
    /// The drivers of its allocated devices.
    pub drivers: BTreeSet<String>,
}

/// Resolves a pod's resource claims (through the API): the claims to
/// prepare, or why the pod must wait (not allocated, not reserved for it,
/// not created yet...).
#[async_trait::async_trait]
pub trait ClaimSource: Send + Sync + 'static {
    /// The pod's claims, each allocated and reserved for it.
    async fn resolve(&self, pod: &Pod) -> Result<Vec<ResolvedClaim>, ClaimError>;
}

/// A claim a container uses, with the devices prepared for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerClaim {
    /// The ResourceClaim's name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// `(driver, device)` for the devices serving the container's request.
    pub devices: Vec<(String, PreparedDevice)>,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClaimEntry {
    claim: ClaimRef,
    /// The pods using it (UIDs).
    pods: BTreeSet<String>,
    /// Its drivers.
    drivers: BTreeSet<String>,
    /// Per driver, what it prepared.
    devices: BTreeMap<String, Vec<PreparedDevice>>,
    /// Every driver prepared it.
    prepared: bool,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Checkpoint {
    kind: String,
    api_version: String,
    entries: Vec<ClaimEntry>,
}

struct Inner {
    drivers: DraDrivers,
    path: PathBuf,
    /// Claim UID → entry. Read by the sync readers (run options,
    /// PodResources); each change is made under this lock, the driver calls
    /// outside it.
    state: Mutex<BTreeMap<String, ClaimEntry>>,
    /// One call at a time per driver: a claim two pods need at once is
    /// prepared once, and a hung driver holds up only its own claims.
    driver_calls: Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// One checkpoint write at a time.
    writing: Mutex<()>,
    /// Wakes [`DraClaims::keep_releasing`]: claims were left without pods.
    released: tokio::sync::Notify,
}

/// The claims prepared on this node. Cheap to clone.
#[derive(Clone)]
pub struct DraClaims {
    inner: Arc<Inner>,
}

/// Why a pod's resource claims could not be named, prepared or released.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// The pod has no claim of that name in `spec.resourceClaims`.
    #[error("pod \"{pod}\" has no resource claim {claim:?}")]
    NoSuchClaim {
        /// The pod, as `namespace/name`.
        pod: String,
        /// The claim's name in the pod.
        claim: String,
    },
    /// The pod's claim sets neither `resourceClaimName` nor
    /// `resourceClaimTemplateName`.
    #[error("pod \"{pod}\", spec.resourceClaim {claim:?}: none of the supported fields are set")]
    NoSource {
        /// The pod, as `namespace/name`.
        pod: String,
        /// The claim's name in the pod.
        claim: String,
    },
    /// The claim made from the pod's template is not in its status yet.
    #[error("pod \"{pod}\": ResourceClaim not created yet")]
    NotCreated {
        /// The pod, as `namespace/name`.
        pod: String,
    },
    /// A claim of the same name but another UID is still prepared on the
    /// node (its pod was force-deleted, say).
    #[error(
        "old ResourceClaim with same name {name} and different UID {other_uid} still exists (previous pod force-deleted?)"
    )]
    StaleClaim {
        /// The claim's name.
        name: String,
        /// The UID of the claim still prepared.
        other_uid: String,
    },
    /// The claims' checkpoint could not be written.
    #[error("cannot write the DRA checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint's path.
        path: std::path::PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The node has no API client yet (a [`ClaimSource`] of cluster mode).
    #[error("not connected to the API server yet")]
    NotConnected,
    /// The API server failed or refused a request: what was asked, and why.
    #[error("{request}: {reason}")]
    Api {
        /// What was asked ("fetch ResourceClaim name (v1)").
        request: String,
        /// The server's answer, or why there was none.
        reason: String,
    },
    /// The claim as the API holds it cannot serve the pod (yet): not
    /// reserved for it, not allocated, not made for it, malformed, or of
    /// an API version this node does not know.
    #[error("{0}")]
    Unusable(String),
    /// Drivers failed: one message per failed call or claim.
    #[error("{operation} dynamic resources: {}", failures.join("; "))]
    Drivers {
        /// `prepare` or `unprepare`.
        operation: &'static str,
        /// What failed, each naming its call and claim.
        failures: Vec<String>,
    },
}

/// The name of the ResourceClaim behind the pod's claim `pod_claim`:
/// `resourceClaimName`, or for a template the generated claim recorded in
/// `status.resourceClaimStatuses`. `Ok(None)`: the template's claim was
/// intentionally not created (nothing to prepare).
pub fn claim_name(pod: &Pod, pod_claim: &str) -> Result<Option<String>, ClaimError> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let spec = pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .and_then(|claims| claims.iter().find(|c| c.name == pod_claim))
        .ok_or_else(|| ClaimError::NoSuchClaim { pod: format!("{namespace}/{name}"), claim: pod_claim.to_owned() })?;
    if let Some(claim) = &spec.resource_claim_name {
        return Ok(Some(claim.clone()));
    }
    if spec.resource_claim_template_name.is_none() {
        return Err(ClaimError::NoSource { pod: format!("{namespace}/{name}"), claim: pod_claim.to_owned() });
    }
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|statuses| statuses.iter().find(|s| s.name == pod_claim))
        .ok_or_else(|| ClaimError::NotCreated { pod: format!("{namespace}/{name}") })?;
    Ok(status.resource_claim_name.clone())
}

impl DraClaims {
    /// The claims of the node whose root dir is `root_dir`, restored from
    /// its checkpoint (a corrupt one is moved aside and reported), prepared
    /// through `drivers`.
    pub fn load(root_dir: &Path, drivers: DraDrivers) -> Self {
        let path = root_dir.join(DRA_CHECKPOINT_FILE);
        let state = restore(&path);
        if !state.is_empty() {
            tracing::info!(claims = state.len(), path = %path.display(), "prepared resource claims restored from the checkpoint");
        }
        DraClaims {
            inner: Arc::new(Inner {
                drivers,
                path,
                state: Mutex::new(state),
                driver_calls: Mutex::default(),
                writing: Mutex::default(),
                released: tokio::sync::Notify::new(),
            }),
        }
    }

    /// The drivers the claims are prepared through.
    pub fn drivers(&self) -> &DraDrivers {
        &self.inner.drivers
    }

    fn state(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, ClaimEntry>> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn driver_lock(&self, driver: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.inner.driver_calls.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(locks.entry(driver.to_owned()).or_default())
    }

    fn persist(&self) -> Result<(), ClaimError> {
        let _writing = self.inner.writing.lock().unwrap_or_else(|p| p.into_inner());
        let checkpoint = Checkpoint {
            kind: CHECKPOINT_KIND.into(),
            api_version: CHECKPOINT_API_VERSION.into(),
            entries: self.state().values().cloned().collect(),
        };
        let failed = |reason: String| ClaimError::Checkpoint { path: self.inner.path.clone(), reason };
        let bytes = serde_json::to_vec(&checkpoint).map_err(|e| failed(e.to_string()))?;
        crate::durable::write(&self.inner.path, &bytes, 0o600).map_err(|e| failed(e.to_string()))
    }

    /// Whether `claim_uid` is prepared.
    pub fn is_prepared(&self, claim_uid: &str) -> bool {
        self.state().get(claim_uid).is_some_and(|e| e.prepared)
    }

    /// The UIDs of the pods using `claim_uid`.
    pub fn pods_of(&self, claim_uid: &str) -> BTreeSet<String> {
        self.state().get(claim_uid).map(|e| e.pods.clone()).unwrap_or_default()
    }

    /// Claims no pod uses any more that a driver has not released yet.
    pub(crate) fn leftovers(&self) -> usize {
        self.state().values().filter(|e| e.pods.is_empty()).count()
    }

    /// Prepares what `pod_uid` needs of `claims`: claims prepared already
    /// only gain the pod; the others are prepared with one call per
    /// driver. Every failure is in the error, each naming its claim.
    pub async fn prepare_pod(&self, pod_uid: &str, claims: &[ResolvedClaim]) -> Result<(), ClaimError> {
        let started = std::time::Instant::now();
        let result = self.prepare_pod_claims(pod_uid, claims).await;
        if !claims.is_empty() {
            self.inner.drivers.metrics().operation(true, result.is_err(), started.elapsed());
        }
        result
    }

    async fn prepare_pod_claims(&self, pod_uid: &str, claims: &[ResolvedClaim]) -> Result<(), ClaimError> {
        let mut drivers: BTreeSet<String> = BTreeSet::new();
        {
            let mut state = self.state();
            for resolved in claims {
                let claim = &resolved.claim;
                if let Some(other) = state.values().find(|e| {
                    e.claim.namespace == claim.namespace && e.claim.name == claim.name && e.claim.uid != claim.uid
                }) {
                    return Err(ClaimError::StaleClaim {
                        name: claim.name.clone(),
                        other_uid: other.claim.uid.clone(),
                    });
                }
            }
            for resolved in claims {
                let entry = state.entry(resolved.claim.uid.clone()).or_insert_with(|| ClaimEntry {
                    claim: resolved.claim.clone(),
                    pods: BTreeSet::new(),
                    drivers: BTreeSet::new(),
                    devices: BTreeMap::new(),
                    prepared: false,
                });
                entry.pods.insert(pod_uid.to_owned());
                entry.drivers.extend(resolved.drivers.iter().cloned());
                if entry.drivers.iter().any(|d| !entry.devices.contains_key(d)) {
                    entry.prepared = false;
                }
                drivers.extend(entry.drivers.iter().filter(|d| !entry.devices.contains_key(*d)).cloned());
            }
        }
        // The pod's reference is on disk before any driver is called.
        self.persist()?;
        let wanted: BTreeSet<&str> = claims.iter().map(|c| c.claim.uid.as_str()).collect();
        let mut failures = Vec::new();
        for driver in drivers {
            let calls = self.inner.drivers.clone();
            let name = driver.clone();
            self.call_driver(
                &driver,
                "NodePrepareResources",
                // What another pod prepared meanwhile is not prepared again.
                |e| {
                    wanted.contains(e.claim.uid.as_str())
                        && e.drivers.contains(&driver)
                        && !e.devices.contains_key(&driver)
                },
                |batch| async move { calls.prepare(&name, &batch).await },
                |entry, devices| {
                    entry.devices.insert(driver.clone(), devices);
                },
                &mut failures,
            )
            .await?;
        }
        {
            let mut state = self.state();
            for uid in &wanted {
                if let Some(entry) = state.get_mut(*uid)
                    && !entry.prepared
                    && entry.drivers.iter().all(|d| entry.devices.contains_key(d))
                {
                    entry.prepared = true;
                    tracing::info!(claim = %format!("{}/{}", entry.claim.namespace, entry.claim.name), claim.uid = %entry.claim.uid, drivers = ?entry.drivers, "resource claim prepared");
                }
            }
        }
        self.persist()?;
        if failures.is_empty() { Ok(()) } else { Err(ClaimError::Drivers { operation: "prepare", failures }) }
    }

    /// Drops `pod_uid` from its claims and releases those no pod uses any
    /// more (one call per driver). A pod with no claims costs nothing. A
    /// claim its driver failed to release stays recorded and is released
    /// again later (`DraClaims::release_leftovers`).
    pub async fn unprepare_pod(&self, pod_uid: &str) -> Result<(), ClaimError> {
        let (held, emptied) = {
            let mut state = self.state();
            let mut held = false;
            let mut emptied = BTreeSet::new();
            for entry in state.values_mut() {
                if entry.pods.remove(pod_uid) {
                    held = true;
                    if entry.pods.is_empty() {
                        emptied.insert(entry.claim.uid.clone());
                    }
                }
            }
            (held, emptied)
        };
        // Most pods hold no claim: nothing to write or call.
        if !held {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let result = match self.persist() {
            Ok(()) => self.release(&emptied).await,
            Err(error) => Err(error),
        };
        self.inner.drivers.metrics().operation(false, result.is_err(), started.elapsed());
        result
    }

    /// Drops every pod not in `live` from the claims (after a restart: pods
    /// gone while the node was down); the claims left without pods are
    /// released in the background by [`DraClaims::keep_releasing`], so a
    /// driver that is not back yet holds up nothing.
    pub fn retain_pods(&self, live: &[String]) -> Result<(), ClaimError> {
        let changed = {
            let mut state = self.state();
            let mut changed = false;
            for entry in state.values_mut() {
                let before = entry.pods.len();
                entry.pods.retain(|p| live.contains(p));
                changed |= entry.pods.len() != before;
            }
            changed
        };
        if changed {
            self.persist()?;
        }
        self.inner.released.notify_one();
        Ok(())
    }

    /// Releases every claim no pod uses that is still recorded (a driver
    /// failed or was away when it was released).
    pub(crate) async fn release_leftovers(&self) -> Result<(), ClaimError> {
        let leftovers: BTreeSet<String> =
            self.state().values().filter(|e| e.pods.is_empty()).map(|e| e.claim.uid.clone()).collect();
        self.release(&leftovers).await
    }

    /// Releases the claims left without pods: when asked
    /// ([`DraClaims::retain_pods`]), whenever a DRA driver registers,
    /// connects or goes away, and every `period` while some are left, until
    /// `stop`.
    pub async fn keep_releasing(self, period: std::time::Duration, stop: tokio_util::sync::CancellationToken) {
        let mut changes = self.drivers().changes();
        loop {
            let left = self.leftovers();
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.inner.released.notified() => {}
                changed = changes.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(period), if left > 0 => {}
            }
            if self.leftovers() > 0
                && let Err(error) = self.release_leftovers().await
            {
                tracing::warn!(%error, "resource claims of removed pods not released yet; trying again later");
            }
        }
    }

    /// Releases the claims in `uids` that no pod uses: per driver, one call
    /// for all of them.
    async fn release(&self, uids: &BTreeSet<String>) -> Result<(), ClaimError> {
        if uids.is_empty() {
            return Ok(());
        }
        let drivers: BTreeSet<String> = {
            let mut state = self.state();
            // A claim without drivers has nothing to release.
            state.retain(|uid, e| !(uids.contains(uid) && e.pods.is_empty() && e.drivers.is_empty()));
            state.values().filter(|e| uids.contains(&e.claim.uid)).flat_map(|e| e.drivers.iter().cloned()).collect()
        };
        let mut failures = Vec::new();
        for driver in drivers {
            let calls = self.inner.drivers.clone();
            let name = driver.clone();
            let released = self
                .call_driver(
                    &driver,
                    "NodeUnprepareResources",
                    // A pod that took the claim again meanwhile keeps it.
                    |e| uids.contains(&e.claim.uid) && e.pods.is_empty() && e.drivers.contains(&driver),
                    |batch| async move { calls.unprepare(&name, &batch).await },
                    |entry, ()| {
                        entry.devices.remove(&driver);
                        entry.drivers.remove(&driver);
                        entry.prepared = false;
                    },
                    &mut failures,
                )
                .await?;
            // Released by every driver and used by no pod: forgotten.
            let forgotten = {
                let mut state = self.state();
                let mut forgotten = false;
                for uid in released {
                    if state.get(&uid).is_some_and(|e| e.drivers.is_empty() && e.pods.is_empty())
                        && let Some(entry) = state.remove(&uid)
                    {
                        tracing::info!(claim = %format!("{}/{}", entry.claim.namespace, entry.claim.name), claim.uid = %uid, "resource claim released");
                        forgotten = true;
                    }
                }
                forgotten
            };
            if forgotten {
                self.persist()?;
            }
        }
        if failures.is_empty() { Ok(()) } else { Err(ClaimError::Drivers { operation: "unprepare", failures }) }
    }

    /// One call to `driver` (`rpc`) for the claims `pick` chooses, decided
    /// under the driver's lock; `apply` records each claim the driver
    /// answered for, every other outcome is a failure naming its claim. The
    /// checkpoint is written after the answers; returns the UIDs answered
    /// for.
    async fn call_driver<T, Fut>(
        &self,
        driver: &str,
        rpc: &str,
        pick: impl Fn(&ClaimEntry) -> bool,
        call: impl FnOnce(Vec<ClaimRef>) -> Fut,
        mut apply: impl FnMut(&mut ClaimEntry, T),
        failures: &mut Vec<String>,
    ) -> Result<Vec<String>, ClaimError>
    where
        Fut: std::future::Future<Output = Result<BTreeMap<String, Result<T, String>>, super::DraError>>,
    {
        let lock = self.driver_lock(driver);
        let _calls = lock.lock().await;
        let batch: Vec<ClaimRef> = self.state().values().filter(|e| pick(e)).map(|e| e.claim.clone()).collect();
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut answers = match call(batch.clone()).await {
            Ok(answers) => answers,
            Err(error) => {
                failures.push(format!("{rpc}: {error}"));
                return Ok(Vec::new());
            }
        };
        let mut done = Vec::new();
        {
            let mut state = self.state();
            for claim in &batch {
                match answers.remove(&claim.uid) {
                    Some(Ok(value)) => {
                        if let Some(entry) = state.get_mut(&claim.uid) {
                            apply(entry, value);
                            done.push(claim.uid.clone());
                        }
                    }
                    Some(Err(reason)) => {
                        failures.push(format!("{rpc} failed for ResourceClaim {}: {reason}", claim.name))
                    }
                    None => failures.push(format!("{rpc} skipped ResourceClaim {}", claim.name)),
                }
            }
        }
        self.persist()?;
        Ok(done)
    }

    /// The claims `container` of `pod` uses that are not prepared on the
    /// node (by their ResourceClaim names, or the reason they cannot be
    /// named): a container must not start without them.
    pub fn unprepared_claims(&self, pod: &Pod, container: &str) -> Vec<String> {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let state = self.state();
        let mut missing = Vec::new();
        for used in claims_used(pod, container) {
            match claim_name(pod, &used.name) {
                Ok(None) => {}
                Ok(Some(name)) => {
                    let prepared =
                        state.values().any(|e| e.claim.namespace == namespace && e.claim.name == name && e.prepared);
                    if !prepared {
                        missing.push(name);
                    }
                }
                Err(reason) => missing.push(reason.to_string()),
            }
        }
        missing
    }

    /// The claims `container` of `pod` uses (`resources.claims`), with the
    /// prepared devices serving its request.
    pub fn container_claims(&self, pod: &Pod, container: &str) -> Vec<ContainerClaim> {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let state = self.state();
        let mut out = Vec::new();
        for used in claims_used(pod, container) {
            let Ok(Some(name)) = claim_name(pod, &used.name) else { continue };
            let Some(entry) = state.values().find(|e| e.claim.namespace == namespace && e.claim.name == name) else {
                continue;
            };
            let request = used.request.as_deref().unwrap_or_default();
            let devices = entry
                .devices
                .iter()
                .flat_map(|(driver, devices)| devices.iter().map(move |d| (driver, d)))
                .filter(|(_, d)| {
                    request.is_empty()
                        || d.request_names.is_empty()
                        || d.request_names.iter().any(|r| r == request || r.split('/').next() == Some(request))
                })
                .map(|(driver, d)| (driver.clone(), d.clone()))
                .collect();
            out.push(ContainerClaim { name, namespace: namespace.clone(), devices });
        }
        out
    }

    /// The CDI device IDs for `container` of `pod`, in claim order, without
    /// repeats.
    pub fn cdi_devices(&self, pod: &Pod, container: &str) -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for claim in self.container_claims(pod, container) {
            for (_, device) in claim.devices {
                for id in device.cdi_device_ids {
                    if !ids.contains(&id) {
                        ids.push(id);
                    }
                }
            }
        }
        ids
    }
}

/// The pod's claims `container` uses (`resources.claims`).
fn claims_used<'a>(pod: &'a Pod, container: &str) -> Vec<&'a k8s_openapi::api::core::v1::ResourceClaim> {
    let Some(spec) = pod.spec.as_ref() else { return Vec::new() };
    let all = spec.init_containers.iter().flatten().chain(spec.containers.iter());
    all.into_iter()
        .find(|c| c.name == container)
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.claims.as_ref())
        .map(|claims| claims.iter().collect())
        .unwrap_or_default()
}

/// The entries of a DRA checkpoint's bytes, or why they are not one.
fn decode_checkpoint(bytes: &[u8]) -> Result<BTreeMap<String, ClaimEntry>, String> {
    match serde_json::from_slice::<Checkpoint>(bytes) {
        Ok(checkpoint) if checkpoint.kind == CHECKPOINT_KIND && checkpoint.api_version == CHECKPOINT_API_VERSION => {
            Ok(checkpoint.entries.into_iter().map(|e| (e.claim.uid.clone(), e)).collect())
        }
        Ok(c) => Err(format!("kind {:?} apiVersion {:?} is not ours", c.kind, c.api_version)),
        Err(e) => Err(e.to_string()),
    }
}

fn restore(path: &Path) -> BTreeMap<String, ClaimEntry> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
        Err(error) => {
            tracing::error!(path = %path.display(), %error, "cannot read the DRA checkpoint; starting without it");
            return BTreeMap::new();
        }
    };
    match decode_checkpoint(&bytes) {
        Ok(entries) => entries,
        Err(reason) => {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            let aside = path.with_file_name(format!("{DRA_CHECKPOINT_FILE}.corrupt-{stamp}"));
            let moved = std::fs::rename(path, &aside);
            tracing::error!(path = %path.display(), %reason, moved_to = %aside.display(), moved = moved.is_ok(), "the DRA checkpoint is corrupt; moved aside, starting clean");
            BTreeMap::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).expect("pod")
    }

    #[test]
    fn claim_names_come_from_the_spec_or_the_status() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [], "resourceClaims": [
                {"name": "direct", "resourceClaimName": "shared-gpu"},
                {"name": "templated", "resourceClaimTemplateName": "gpu-template"},
                {"name": "skipped", "resourceClaimTemplateName": "gpu-template"},
                {"name": "pending", "resourceClaimTemplateName": "gpu-template"},
                {"name": "empty"},
            ]},
            "status": {"resourceClaimStatuses": [
                {"name": "templated", "resourceClaimName": "p-templated-x7k2"},
                {"name": "skipped"},
            ]},
        }));
        assert_eq!(claim_name(&p, "direct"), Ok(Some("shared-gpu".into())));
        assert_eq!(claim_name(&p, "templated"), Ok(Some("p-templated-x7k2".into())));
        assert_eq!(claim_name(&p, "skipped"), Ok(None));
        let pending = claim_name(&p, "pending").expect_err("not created");
        assert_eq!(pending.to_string(), "pod \"ns/p\": ResourceClaim not created yet");
        let empty = claim_name(&p, "empty").expect_err("no field");
        assert!(empty.to_string().contains("none of the supported fields are set"), "{empty}");
    }

    #[test]
    fn a_corrupt_checkpoint_is_moved_aside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(DRA_CHECKPOINT_FILE);
        std::fs::write(&path, b"{not json").expect("write");
        assert!(restore(&path).is_empty());
        assert!(!path.exists());
        let aside = std::fs::read_dir(dir.path()).expect("dir").count();
        assert_eq!(aside, 1, "the corrupt file is kept aside");
    }

    /// Fuzz target: the DRA checkpoint's bytes as the node reads them at
    /// start: entries, or a reason; never a panic.
    #[test]
    fn fuzz_dra_checkpoint() {
        let entry = ClaimEntry {
            claim: ClaimRef { namespace: "default".into(), uid: "c1".into(), name: "gpu".into() },
            pods: BTreeSet::from(["p1".to_owned()]),
            drivers: BTreeSet::from(["gpu.example.com".to_owned()]),
            devices: BTreeMap::from([(
                "gpu.example.com".to_owned(),
                vec![PreparedDevice {
                    request_names: vec!["gpu".into()],
                    pool: "n1".into(),
                    device: "gpu-0".into(),
                    cdi_device_ids: vec!["example.com/gpu=gpu-0".into()],
                }],
            )]),
            prepared: true,
        };
        let checkpoint = Checkpoint {
            kind: CHECKPOINT_KIND.into(),
            api_version: CHECKPOINT_API_VERSION.into(),
            entries: vec![entry],
        };
        let seed = serde_json::to_string(&checkpoint).expect("json");
        assert_eq!(decode_checkpoint(seed.as_bytes()).map(|e| e.len()), Ok(1), "the seed is a checkpoint");
        let ran = crate::fuzz::Fuzz::new("dra-checkpoint").seed(seed).run(|input| {
            let _ = decode_checkpoint(input);
        });
        assert!(ran > 1);
    }
}
