//! Volume facts from the API: the CSIDriver objects (watched, as the
//! kubelet's informer does: `podInfoOnMount`, `volumeLifecycleModes`),
//! `persistentVolumeClaim` volumes resolved through the claim to its bound
//! PersistentVolume and the secrets its CSI source names, and the
//! ConfigMaps, Secrets and service-account tokens of configMap, secret and
//! projected volumes and env references ([`ApiVolumes`]).
//!
//! A claim that is not bound yet is an error with a message saying so; the
//! lifecycle retries the pod's volumes with backoff and shows the message
//! in the pod's status meanwhile.

use std::collections::BTreeMap;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret, SecretReference, Service, ServiceAccount,
};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use tokio::sync::watch;

use super::describe;
use super::object_watch::{self, ObjectWatches};
use super::read_cache::ReadCache;
use crate::csi::Secrets;
use crate::volume::{ApiObjects, ClaimedVolume, CsiDriverObjects, ObjectKind, VolumeClaims};
use kubelet_pods::ApiError;

/// Upstream's name of the VolumeAttachment of volume `handle` of `driver`
/// on `node`.
pub fn attachment_name(handle: &str, driver: &str, node: &str) -> String {
    format!("csi-{}", crate::volume::csi::sha256_hex(format!("{handle}{driver}{node}").as_bytes()))
}

/// Keeps `objects` equal to the cluster's CSIDriver objects until the
/// stream ends (run it under the node's shutdown): the one mirror loop
/// (`mirror.rs`).
pub(crate) async fn follow_csi_drivers(client: kube::Client, objects: CsiDriverObjects) {
    crate::mirror::follow(client, objects).await;
}

/// Volume sources from the API with the node's identity, once cluster mode
/// has its client: the [`VolumeClaims`] (claim → bound PersistentVolume →
/// its CSI source's secrets) and the [`ApiObjects`] (ConfigMaps, Secrets,
/// service-account tokens bound to the pod).
#[derive(Clone)]
pub struct ApiVolumes {
    client: watch::Receiver<Option<kube::Client>>,
    node_name: String,
    /// The cluster's services, kept by a watch (started at the first
    /// container start that reads them).
    service_watch: crate::service_watch::ServiceWatch,
    /// The services of each namespace as last listed, and when, while the
    /// watch has not listed: a burst of container starts lists a namespace
    /// once (see [`SERVICES_FRESH`]).
    services: ReadCache<String, Vec<Service>>,
    /// Tokens requested for pods, reused until 80% of their life has
    /// passed (upstream's token manager renews them then).
    tokens: std::sync::Arc<std::sync::Mutex<TokenCache>>,
    /// ConfigMaps and Secrets as last read for volume rewrites, by (kind,
    /// namespace, name) (`None`: no such object), while their watch has
    /// not listed them.
    objects: ReadCache<ObjectKey, Option<BTreeMap<String, Vec<u8>>>>,
    /// The watches that keep the objects volume rewrites read current.
    watches: ObjectWatches,
}

/// An object by kind, namespace and name.
type ObjectKey = (ObjectKind, String, String);

/// Tokens by (pod UID, audience, expiration seconds asked): when
/// requested, the life the server granted, and the token.
type TokenCache =
    std::collections::HashMap<(String, Option<String>, i64), (std::time::Instant, std::time::Duration, String)>;

/// Whether a token requested `age` ago with `life` granted is still fresh:
/// less than 80% of its life has passed.
fn token_fresh(age: std::time::Duration, life: std::time::Duration) -> bool {
    age < life.mul_f64(0.8)
}

/// When a token request for a pod created less than [`FRESH_POD`] ago is
/// refused (403, 404), the API server's own view of the pod (its node
/// authorizer's graph, NodeRestriction's pod cache, both fed by its
/// informers) may lag behind the node, which saw the pod bound at once:
/// it is asked again after each of these delays before the refusal counts.
/// Measured with 50 nodes under churn: about one start in twenty was
/// refused so (`node requested token bound to a pod scheduled on a
/// different node`, `no relationship found`, `pod not found`), and then
/// waited for the volume backoff (0.5 s, 1 s, ...).
const LAGGING_VIEW_RETRIES: [std::time::Duration; 4] = [
    std::time::Duration::from_millis(100),
    std::time::Duration::from_millis(200),
    std::time::Duration::from_millis(400),
    std::time::Duration::from_millis(800),
];

/// How young a pod's refusals are taken for the API server's lag.
const FRESH_POD: jiff::SignedDuration = jiff::SignedDuration::from_secs(10);

/// How long a namespace's listed services are reused for containers'
/// link variables (upstream reads them from a watch cache).
pub(crate) const SERVICES_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

impl ApiVolumes {
    /// Reads with the client `client` holds once it holds one, for node
    /// `node_name` (whose VolumeAttachments it reads).
    pub fn new(client: watch::Receiver<Option<kube::Client>>, node_name: &str) -> ApiVolumes {
        ApiVolumes {
            objects: ReadCache::default(),
            watches: ObjectWatches::default(),
            client,
            node_name: node_name.to_owned(),
            service_watch: crate::service_watch::ServiceWatch::default(),
            services: ReadCache::default(),
            tokens: std::sync::Arc::default(),
        }
    }

    fn client(&self) -> Result<kube::Client, ApiError> {
        self.client.borrow().clone().ok_or(ApiError::NotConnected)
    }

    /// A new token for `pod`'s service account (a TokenRequest bound to it),
    /// and when it expires.
    async fn request_token(
        &self,
        pod: &Pod,
        audience: Option<&str>,
        expiration_seconds: i64,
    ) -> Result<(String, Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>), ApiError> {
        let client = self.client()?;
        let namespace = pod.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let account =
            pod.spec.as_ref().and_then(|s| s.service_account_name.clone()).unwrap_or_else(|| "default".into());
        let request = TokenRequest {
            metadata: ObjectMeta::default(),
            spec: TokenRequestSpec {
                audiences: audience.map(|a| vec![a.to_owned()]).unwrap_or_default(),
                expiration_seconds: Some(expiration_seconds),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: pod.metadata.name.clone(),
                    uid: pod.metadata.uid.clone(),
                }),
            },
            status: None,
        };
        let api: Api<ServiceAccount> = Api::namespaced(client, &namespace);
        let created = pod.metadata.creation_timestamp.as_ref().map(|t| t.0);
        let mut lagging = LAGGING_VIEW_RETRIES.iter();
        let answer = loop {
            match api.create_token_request(&account, &super::post_params(), &request).await {
                Ok(answer) => break answer,
                Err(error)
                    if (super::is_code(&error, 403) || super::is_code(&error, 404))
                        && created.is_some_and(|at| jiff::Timestamp::now().duration_since(at) < FRESH_POD)
                        && let Some(delay) = lagging.next() =>
                {
                    tracing::debug!(pod = ?pod.metadata.name, error = %describe(&error), ?delay, "the API server does not see the pod on this node yet; asking again");
                    tokio::time::sleep(*delay).await;
                }
                Err(error) => {
                    return Err(failed_request(
                        format!("cannot get a token for service account {namespace}/{account}"),
                        &error,
                    ));
                }
            }
        };
        answer
            .status
            .map(|s| (s.token, Some(s.expiration_timestamp)))
            .ok_or_else(|| ApiError::Invalid("the token request was answered without a token".to_owned()))
    }

    /// The data of the secret `reference` names (none: empty).
    async fn secrets(&self, reference: Option<&SecretReference>) -> Result<Secrets, ApiError> {
        let Some(reference) = reference else { return Ok(Secrets::default()) };
        let name = reference.name.clone().unwrap_or_default();
        let namespace = reference.namespace.clone().unwrap_or_else(|| "default".into());
        let data = self
            .data(ObjectKind::Secret, &namespace, &name)
            .await?
            .ok_or_else(|| ApiError::Invalid(format!("Secret {namespace}/{name} not found")))?;
        let mut values = BTreeMap::new();
        for (key, value) in data {
            let text = String::from_utf8(value)
                .map_err(|_| ApiError::Invalid(format!("Secret {namespace}/{name}: key {key} is not UTF-8")))?;
            values.insert(key, text);
        }
        Ok(Secrets(values))
    }
}

#[async_trait::async_trait]
impl VolumeClaims for ApiVolumes {
    /// The VolumeAttachment upstream's attach/detach controller creates
    /// for the volume and this node (`csi-<sha256(handle + driver +
    /// node)>`), once its attacher set `status.attached`; its
    /// `attachmentMetadata` is the publish context.
    async fn attachment(&self, driver: &str, handle: &str) -> Result<BTreeMap<String, String>, ApiError> {
        // First the attach/detach controller's word, as the kubelet checks
        // it: the Node's `status.volumesAttached` lists the volume.
        let unique = crate::volume::csi::unique_volume_name(driver, handle);
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client()?);
        let node = nodes
            .get(&self.node_name)
            .await
            .map_err(|e| failed_request(format!("reading Node {}", self.node_name), &e))?;
        let listed = node.status.and_then(|s| s.volumes_attached).unwrap_or_default().iter().any(|v| v.name == unique);
        if !listed {
            return Err(ApiError::NotReady(format!(
                "volume {unique} not attached according to node status (status.volumesAttached of Node {})",
                self.node_name
            )));
        }
        let name = attachment_name(handle, driver, &self.node_name);
        let attachments: Api<VolumeAttachment> = Api::all(self.client()?);
        // Until it exists, the Node authorizer relates no VolumeAttachment
        // of that name to the node: 403, as 404 would say.
        let found = match attachments.get_opt(&name).await {
            Ok(found) => found,
            Err(error) if super::is_code(&error, 403) => None,
            Err(error) => return Err(failed_request(format!("reading VolumeAttachment {name}"), &error)),
        };
        let Some(attachment) = found else {
            return Err(ApiError::NotReady(format!(
                "waiting for VolumeAttachment {name} (driver {driver}, volume {handle})"
            )));
        };
        let status = attachment.status.unwrap_or_default();
        if !status.attached {
            let error = status.attach_error.and_then(|e| e.message).map(|m| format!(": {m}")).unwrap_or_default();
            return Err(ApiError::NotReady(format!("VolumeAttachment {name} is not attached yet{error}")));
        }
        Ok(status.attachment_metadata.unwrap_or_default())
    }

    async fn resolve(&self, namespace: &str, claim: &str, read_only: bool) -> Result<ClaimedVolume, ApiError> {
        let client = self.client()?;
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
        let found = claims
            .get_opt(claim)
            .await
            .map_err(|e| failed_request(format!("cannot read PersistentVolumeClaim {namespace}/{claim}"), &e))?
            .ok_or_else(|| ApiError::Invalid(format!("PersistentVolumeClaim {namespace}/{claim} not found")))?;
        let phase = found.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_else(|| "Pending".into());
        let volume_name = found.spec.as_ref().and_then(|s| s.volume_name.clone()).filter(|v| !v.is_empty());
        let Some(volume_name) = volume_name.filter(|_| phase == "Bound") else {
            return Err(ApiError::NotReady(format!(
                "PersistentVolumeClaim {namespace}/{claim} is not bound to a volume yet (phase {phase})"
            )));
        };
        let volumes: Api<PersistentVolume> = Api::all(client);
        let volume = volumes
            .get(&volume_name)
            .await
            .map_err(|e| failed_request(format!("cannot read PersistentVolume {volume_name}"), &e))?;
        let csi = volume.spec.as_ref().and_then(|s| s.csi.clone()).ok_or_else(|| {
            ApiError::Invalid(format!("PersistentVolume {volume_name} (claim {namespace}/{claim}) is not a CSI volume; only CSI volumes are supported"))
        })?;
        let stage_secrets = self.secrets(csi.node_stage_secret_ref.as_ref()).await?;
        let publish_secrets = self.secrets(csi.node_publish_secret_ref.as_ref()).await?;
        let expand_secrets = self.secrets(csi.node_expand_secret_ref.as_ref()).await?;
        Ok(ClaimedVolume {
            volume,
            claim_read_only: read_only,
            stage_secrets,
            publish_secrets,
            expand_secrets,
            claim: Some(found),
        })
    }

    /// A strategic merge patch of the claim's `status` subresource, which
    /// the Node authorizer lets a node write for the claims of its pods
    /// (NodeRestriction: capacity, conditions and allocated resources only).
    async fn patch_claim_status(
        &self,
        namespace: &str,
        claim: &str,
        patch: serde_json::Value,
    ) -> Result<PersistentVolumeClaim, ApiError> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client()?, namespace);
        claims
            .patch_status(claim, &kube::api::PatchParams::default(), &kube::api::Patch::Strategic(patch))
            .await
            .map_err(|e| failed_request(format!("cannot write PersistentVolumeClaim {namespace}/{claim}'s status"), &e))
    }

    /// A fresh TokenRequest each time (as upstream's CSI mounter asks at
    /// each publish): the driver gets the token with its expiry.
    async fn pod_token(
        &self,
        pod: &Pod,
        audience: &str,
        expiration_seconds: i64,
    ) -> Result<(String, String), ApiError> {
        let audience = (!audience.is_empty()).then_some(audience);
        let (token, expires) = self.request_token(pod, audience, expiration_seconds).await?;
        let expires = expires
            .map(|t| t.0)
            .unwrap_or_else(|| jiff::Timestamp::now() + jiff::SignedDuration::from_secs(expiration_seconds));
        Ok((token, expires.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()))
    }
}

#[async_trait::async_trait]
impl ApiObjects for ApiVolumes {
    async fn data(
        &self,
        kind: ObjectKind,
        namespace: &str,
        name: &str,
    ) -> Result<Option<BTreeMap<String, Vec<u8>>>, ApiError> {
        let client = self.client()?;
        let failed = |e: kube::Error| failed_request(format!("cannot read {} {namespace}/{name}", kind.noun()), &e);
        match kind {
            ObjectKind::ConfigMap => {
                let api: Api<ConfigMap> = Api::namespaced(client, namespace);
                Ok(api.get_opt(name).await.map_err(failed)?.map(object_watch::configmap_data))
            }
            ObjectKind::Secret => {
                let api: Api<Secret> = Api::namespaced(client, namespace);
                Ok(api.get_opt(name).await.map_err(failed)?.map(object_watch::secret_data))
            }
        }
    }

    async fn data_cached(
        &self,
        kind: ObjectKind,
        namespace: &str,
        name: &str,
        max_age: std::time::Duration,
    ) -> Result<Option<BTreeMap<String, Vec<u8>>>, ApiError> {
        if let Some(data) = self.watches.read(&self.client()?, kind, namespace, name).await {
            return Ok(data);
        }
        // Its watch has not listed it (yet): read it. Objects nobody read
        // for ten periods (their pods are gone) are forgotten.
        let key = (kind, namespace.to_owned(), name.to_owned());
        self.objects.get_or_read(key, max_age, max_age * 10, || self.data(kind, namespace, name)).await
    }

    async fn data_current(
        &self,
        kind: ObjectKind,
        namespace: &str,
        name: &str,
    ) -> Result<Option<BTreeMap<String, Vec<u8>>>, ApiError> {
        // The object's watch, shared with the volume rewrites; an object it
        // does not hold (perhaps created a moment ago) is read, so that a
        // start never misses one that exists.
        match self.watches.read(&self.client()?, kind, namespace, name).await {
            Some(Some(data)) => Ok(Some(data)),
            _ => self.data(kind, namespace, name).await,
        }
    }

    async fn service_account_token(
        &self,
        pod: &Pod,
        audience: Option<&str>,
        expiration_seconds: i64,
    ) -> Result<String, ApiError> {
        let key = (pod.metadata.uid.clone().unwrap_or_default(), audience.map(str::to_owned), expiration_seconds);
        let cached = self.tokens.lock().unwrap_or_else(|p| p.into_inner()).get(&key).cloned();
        if let Some((_, _, token)) = cached.filter(|(at, life, _)| token_fresh(at.elapsed(), *life)) {
            return Ok(token);
        }
        let requested_at = std::time::Instant::now();
        let (token, expires) = self.request_token(pod, audience, expiration_seconds).await?;
        // The server may grant less than asked (a maximum expiration):
        // renewal follows what it granted.
        let asked = std::time::Duration::from_secs(u64::try_from(expiration_seconds).unwrap_or(0));
        let granted = expires
            .map(|at| std::time::Duration::try_from(jiff::Timestamp::now().duration_until(at.0)).unwrap_or_default())
            .unwrap_or(asked);
        let mut tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        tokens.retain(|_, (at, life, _)| token_fresh(at.elapsed(), *life));
        tokens.insert(key, (requested_at, granted.min(asked), token.clone()));
        Ok(token)
    }

    async fn services(&self, namespace: &str) -> Result<Vec<Service>, ApiError> {
        if let Some(services) = self.service_watch.read(&self.client()?, namespace).await {
            return Ok(services);
        }
        // Its watch has not listed (yet): a burst of starts waits for one
        // listing instead of making its own.
        let list = || async {
            let api: Api<Service> = Api::namespaced(self.client()?, namespace);
            let list = api
                .list(&kube::api::ListParams::default())
                .await
                .map_err(|e| failed_request(format!("cannot list the services of {namespace}"), &e))?;
            Ok(list.items)
        };
        self.services.get_or_read(namespace.to_owned(), SERVICES_FRESH, SERVICES_FRESH * 60, list).await
    }
}

/// A request the server failed: `request`, and the server's answer.
fn failed_request(request: String, error: &kube::Error) -> ApiError {
    ApiError::Request { request, reason: describe(error) }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn a_token_is_renewed_after_four_fifths_of_its_life() {
        let life = Duration::from_secs(600);
        assert!(super::token_fresh(Duration::from_secs(479), life));
        assert!(!super::token_fresh(Duration::from_secs(480), life));
        assert!(!super::token_fresh(Duration::ZERO, Duration::ZERO));
    }
}
