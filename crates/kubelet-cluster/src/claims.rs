//! Resource claims and ResourceSlices through the API, in whichever
//! version of `resource.k8s.io` the server serves.
//!
//! - [`ServedVersion`] asks the server's discovery which of `v1` (1.34+),
//!   `v1beta2` (1.33+) and `v1beta1` (1.32+) it serves, the newest first,
//!   once, and again after a request at the chosen version is answered
//!   404 (the server was upgraded or reconfigured). Objects are read in
//!   that version and turned into `v1`'s model
//!   ([`kubelet_api::resource::to_hub`]), so the rest of the node knows
//!   one model.
//! - [`ApiClaims`] resolves a pod's claims: the named ResourceClaim, or the
//!   one generated from a template and recorded in the pod's
//!   `status.resourceClaimStatuses` (which must be owned by the pod); each
//!   must be reserved for the pod and allocated. The drivers come from the
//!   allocation's results.
//! - `wipe_slices`: the ResourceSlices are the drivers' to publish. At
//!   start the node deletes those of this node (the drivers publish them
//!   again when they register), and once no instance of a driver has been
//!   connected for the wiping delay (upstream: 30 s), that driver's slices
//!   of this node are deleted, so the scheduler stops placing claims on
//!   devices nobody serves.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams};
use kubelet_api::resource::{self as resource_api, ResourceVersion};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::describe;
use crate::dra::{ClaimError, ClaimRef, ClaimSource, DraDrivers, ResolvedClaim, claim_name};

/// Upstream's delay between a driver's last instance going away and the
/// deletion of its ResourceSlices.
pub(crate) const SLICE_WIPING_DELAY: Duration = Duration::from_secs(30);

/// The version of `resource.k8s.io` the API server serves, found by
/// discovery and remembered until a request at it is answered 404.
#[derive(Clone, Default)]
pub struct ServedVersion {
    /// `None`: not asked yet; `Some(None)`: the server serves none the
    /// node knows.
    found: Arc<Mutex<Option<Option<ResourceVersion>>>>,
}

impl ServedVersion {
    /// The newest version that serves `resourceclaims` and
    /// `resourceslices`; `None` when the server serves none (Kubernetes
    /// 1.31 and older, or a 1.32–1.33 server without the beta API on).
    pub async fn get(&self, client: &kube::Client) -> Result<Option<ResourceVersion>, kube::Error> {
        if let Some(found) = *self.found.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(found);
        }
        let mut found = None;
        for version in ResourceVersion::PREFERENCE {
            match client.list_api_group_resources(version.api_version()).await {
                Ok(list) => {
                    let serves = |plural: &str| list.resources.iter().any(|r| r.name == plural);
                    if serves("resourceclaims") && serves("resourceslices") {
                        found = Some(version);
                        break;
                    }
                }
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => return Err(error),
            }
        }
        match found {
            Some(version) => tracing::info!(version = %version, "the API server serves structured DRA"),
            None => tracing::info!(
                "the API server serves no version of resource.k8s.io this node knows (v1, v1beta2, v1beta1)"
            ),
        }
        *self.found.lock().unwrap_or_else(|p| p.into_inner()) = Some(found);
        Ok(found)
    }

    /// Forgets what was found: the next [`ServedVersion::get`] asks again.
    pub(crate) fn forget(&self) {
        *self.found.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// The `kind`/`plural` of `resource.k8s.io` at `version` (for a dynamic
/// `Api`).
pub fn api_resource(version: ResourceVersion, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: resource_api::GROUP.into(),
        version: version.as_str().into(),
        api_version: version.api_version().into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

impl ServedVersion {
    /// Reads the ResourceClaim `namespace/name` at `version` (what
    /// [`ServedVersion::get`] found) into `v1`'s model. A 404 may be the
    /// version gone as well as the claim: discovery is asked again next
    /// time.
    pub async fn get_claim(
        &self,
        client: &kube::Client,
        version: ResourceVersion,
        namespace: &str,
        name: &str,
    ) -> Result<ResourceClaim, ClaimError> {
        let resource = api_resource(version, "ResourceClaim", "resourceclaims");
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &resource);
        let object = api.get(name).await.map_err(|error| {
            if matches!(&error, kube::Error::Api(status) if status.code == 404) {
                self.forget();
            }
            ClaimError::Api { request: format!("fetch ResourceClaim {name} ({version})"), reason: describe(&error) }
        })?;
        claim_in_hub(object, version, name)
    }
}

/// A ResourceClaim read at `version`, in `v1`'s model.
fn claim_in_hub(object: DynamicObject, version: ResourceVersion, name: &str) -> Result<ResourceClaim, ClaimError> {
    let mut value =
        serde_json::to_value(object).map_err(|e| ClaimError::Unusable(format!("ResourceClaim {name}: {e}")))?;
    value["apiVersion"] = version.api_version().into();
    value["kind"] = "ResourceClaim".into();
    resource_api::to_hub(&mut value);
    serde_json::from_value(value)
        .map_err(|e| ClaimError::Unusable(format!("ResourceClaim {name} ({version}) is malformed: {e}")))
}

/// Resolves claims with the client `client` holds once it holds one.
pub struct ApiClaims {
    client: watch::Receiver<Option<kube::Client>>,
    served: ServedVersion,
}

impl ApiClaims {
    /// Claims read with the node's client.
    pub fn new(client: watch::Receiver<Option<kube::Client>>) -> Self {
        ApiClaims { client, served: ServedVersion::default() }
    }
}

#[async_trait::async_trait]
impl ClaimSource for ApiClaims {
    async fn resolve(&self, pod: &Pod) -> Result<Vec<ResolvedClaim>, ClaimError> {
        let client = self.client.borrow().clone().ok_or(ClaimError::NotConnected)?;
        let namespace = pod.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let mut resolved = Vec::new();
        let pod_claims = pod.spec.as_ref().and_then(|s| s.resource_claims.clone()).unwrap_or_default();
        if pod_claims.is_empty() {
            return Ok(resolved);
        }
        let version = self
            .served
            .get(&client)
            .await
            .map_err(|e| ClaimError::Api {
                request: "API discovery of resource.k8s.io failed".to_owned(),
                reason: describe(&e),
            })?
            .ok_or_else(|| {
                // Asked again next time: the server may be reconfigured.
                self.served.forget();
                ClaimError::Unusable(
                    "the API server serves no version of resource.k8s.io this node knows (v1, v1beta2, v1beta1): \
                     resource claims cannot be read"
                        .to_owned(),
                )
            })?;
        for pod_claim in &pod_claims {
            let Some(name) = claim_name(pod, &pod_claim.name)? else { continue };
            let claim = self.served.get_claim(&client, version, &namespace, &name).await?;
            let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
            if pod_claim.resource_claim_template_name.is_some() {
                let owned = claim
                    .metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.controller == Some(true) && o.uid == pod_uid);
                if !owned {
                    return Err(ClaimError::Unusable(format!(
                        "ResourceClaim {namespace}/{name} was not created for pod {namespace}/{pod_name} (pod is not owner)"
                    )));
                }
            }
            let status = claim.status.as_ref();
            let reserved =
                status.and_then(|s| s.reserved_for.as_ref()).is_some_and(|r| r.iter().any(|c| c.uid == pod_uid));
            if !reserved {
                return Err(ClaimError::Unusable(format!(
                    "pod {pod_name} ({pod_uid}) is not allowed to use ResourceClaim {name} ({claim_uid})"
                )));
            }
            let allocation = status
                .and_then(|s| s.allocation.as_ref())
                .ok_or_else(|| ClaimError::Unusable(format!("ResourceClaim {name}: not allocated")))?;
            let drivers: BTreeSet<String> = allocation
                .devices
                .as_ref()
                .and_then(|d| d.results.as_ref())
                .map(|results| results.iter().map(|r| r.driver.clone()).collect())
                .unwrap_or_default();
            resolved.push(ResolvedClaim {
                claim: ClaimRef { namespace: namespace.clone(), uid: claim_uid, name },
                drivers,
            });
        }
        Ok(resolved)
    }
}

/// Deletes this node's ResourceSlices (of one driver, or all), retrying
/// with backoff until it is done, `stop` is cancelled, or (for one driver)
/// an instance of it is connected again (its slices are its own then).
async fn delete_slices(
    client: &kube::Client,
    node: &str,
    driver: Option<&str>,
    drivers: &DraDrivers,
    stop: &CancellationToken,
) {
    let served = ServedVersion::default();
    let mut selector = format!("spec.nodeName={node}");
    if let Some(driver) = driver {
        selector.push_str(&format!(",spec.driver={driver}"));
    }
    let mut backoff = crate::retry::RetryBackoff::new(Duration::from_secs(1), Duration::from_secs(300));
    loop {
        // What the server does not serve (no resource.k8s.io in Kubernetes
        // 1.28, nor in 1.32–1.33 unless turned on) holds no slices.
        let version = match served.get(client).await {
            Ok(Some(version)) => version,
            Ok(None) => {
                tracing::info!(node, "this API server serves no ResourceSlices: none to delete");
                return;
            }
            Err(error) => {
                let delay = backoff.next_delay();
                tracing::warn!(node, error = %describe(&error), retry_in = ?delay, "API discovery of resource.k8s.io failed; retrying");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(delay) => {}
                }
                continue;
            }
        };
        let api: Api<DynamicObject> =
            Api::all_with(client.clone(), &api_resource(version, "ResourceSlice", "resourceslices"));
        if driver.is_some_and(|d| drivers.usable(d)) {
            tracing::info!(
                node,
                driver = driver.unwrap_or_default(),
                "the DRA driver is back; its ResourceSlices stay"
            );
            return;
        }
        match api.delete_collection(&DeleteParams::default(), &ListParams::default().fields(&selector)).await {
            Ok(_) => {
                tracing::info!(node, driver = driver.unwrap_or("(all)"), %version, "ResourceSlices of this node deleted");
                return;
            }
            // The version went away under the node: ask again (after the
            // backoff, should the server keep saying so).
            Err(kube::Error::Api(status)) if status.code == 404 => {
                served.forget();
                let delay = backoff.next_delay();
                tracing::info!(node, %version, retry_in = ?delay, "ResourceSlices are no longer served at this version; asking discovery again");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(delay) => {}
                }
            }
            // A refusal (403, 405, 422) will not change by asking again.
            Err(kube::Error::Api(status)) if (400..500).contains(&status.code) && status.code != 429 => {
                tracing::warn!(node, driver = driver.unwrap_or("(all)"), code = status.code, error = %status.message, "the API server refuses to delete this node's ResourceSlices; not retrying");
                return;
            }
            Err(error) => {
                let delay = backoff.next_delay();
                tracing::warn!(node, driver = driver.unwrap_or("(all)"), error = %describe(&error), retry_in = ?delay, "cannot delete ResourceSlices; retrying");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// Deletes this node's ResourceSlices at start, then each driver's once
/// none of its instances has been connected for `delay`. Runs until
/// `stop`.
pub(crate) async fn wipe_slices(
    client: kube::Client,
    node: String,
    drivers: DraDrivers,
    delay: Duration,
    stop: CancellationToken,
) {
    delete_slices(&client, &node, None, &drivers, &stop).await;
    let mut changes = drivers.changes();
    // Drivers seen usable, and when each became unusable.
    let mut unusable_since: BTreeMap<String, tokio::time::Instant> = BTreeMap::new();
    let mut known: BTreeSet<String> = BTreeSet::new();
    loop {
        changes.mark_unchanged();
        let listed: BTreeSet<String> = drivers.list().into_iter().map(|i| i.driver).collect();
        known.extend(listed.iter().cloned());
        let now = tokio::time::Instant::now();
        for driver in &known {
            if drivers.usable(driver) {
                unusable_since.remove(driver);
            } else {
                unusable_since.entry(driver.clone()).or_insert(now);
            }
        }
        // A delay too large to add is no deadline at all (wiping disabled).
        let due_at = |since: &tokio::time::Instant| since.checked_add(delay);
        let due: Vec<String> = unusable_since
            .iter()
            .filter(|(_, since)| due_at(since).is_some_and(|at| now >= at))
            .map(|(d, _)| d.clone())
            .collect();
        for driver in due {
            tracing::info!(%driver, ?delay, "no instance of the DRA driver connected for the wiping delay");
            delete_slices(&client, &node, Some(&driver), &drivers, &stop).await;
            unusable_since.remove(&driver);
            known.remove(&driver);
        }
        let next = unusable_since.values().filter_map(due_at).min();
        tokio::select! {
            () = stop.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
            () = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}
