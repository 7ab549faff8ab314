//! Volumes and env from API objects: `configMap`, `secret` and `projected`
//! volumes (configMap, secret, downwardAPI and serviceAccountToken
//! sources), and env from `configMapKeyRef`/`secretKeyRef`/`envFrom`.
//!
//! The objects come from an [`ApiObjects`] (cluster mode reads them with the
//! node's identity). As upstream:
//! - a missing object fails the volume (`configmap "x" not found`) unless
//!   the reference is `optional`, which gives an empty volume or no env;
//! - `items` pick keys and paths (a missing key fails unless optional);
//!   without items every key becomes a file of its name;
//! - file modes come from the item's `mode`, else `defaultMode`, else 0644;
//! - a projected service-account token is requested for the pod (bound to
//!   it) with its audience and expiry (default 1 h, at least 10 min).
//!
//! `pull_secrets` reads a pod's `imagePullSecrets` for its image pulls.
//!
//! The files are written with the kubelet's atomic layout (see
//! [`super::atomic_writer`]) and written again while the pod runs (see
//! [`super::VolumeManager::refresh`]): a changed object, or an optional
//! one created later, reaches the running containers.
//!
//! Not done: secrets on tmpfs (they are written to the pod's directory).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{KeyToPath, Pod, VolumeProjection};

use super::VolumeError;
use super::atomic_writer::{FileData, Payload};
use super::downward_api::DownwardContext;
use crate::ApiError;

/// The kinds of object a pod may reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ObjectKind {
    /// A ConfigMap (`data` and `binaryData`).
    ConfigMap,
    /// A Secret (`data`).
    Secret,
}

impl ObjectKind {
    /// The lower-case name upstream's messages use.
    pub fn noun(self) -> &'static str {
        match self {
            ObjectKind::ConfigMap => "configmap",
            ObjectKind::Secret => "secret",
        }
    }
}

/// Reads the API objects pods reference.
#[async_trait::async_trait]
pub trait ApiObjects: Send + Sync + 'static {
    /// The data of object `name` of `kind` in `namespace`; `None` if there
    /// is no such object.
    async fn data(
        &self,
        kind: ObjectKind,
        namespace: &str,
        name: &str,
    ) -> Result<Option<BTreeMap<String, Vec<u8>>>, ApiError>;

    /// A service-account token for `pod` (bound to it), for `audience` (the
    /// API server's when `None`), valid `expiration_seconds`.
    async fn service_account_token(
        &self,
        pod: &Pod,
        audience: Option<&str>,
        expiration_seconds: i64,
    ) -> Result<String, ApiError>;

    /// [`ApiObjects::data`], or a copy read at most `max_age` ago: the
    /// periodic rewrite of running pods' volumes reads through it, so that
    /// many pods sharing an object read it once. By default: a fresh read.
    async fn data_cached(
        &self,
        kind: ObjectKind,
        namespace: &str,
        name: &str,
        max_age: std::time::Duration,
    ) -> Result<Option<BTreeMap<String, Vec<u8>>>, ApiError> {
        let _ = max_age;
        self.data(kind, namespace, name).await
    }

    /// [`ApiObjects::data`] as a pod start reads it: a copy kept current by
    /// a watch where the node has one (upstream's `Watch` strategy: a
    /// start reads the watch's store), else a fresh read. By default: a
    /// fresh read.
    async fn data_current(
        &self,
        kind: ObjectKind,
        namespace: &str,
        name: &str,
    ) -> Result<Option<BTreeMap<String, Vec<u8>>>, ApiError> {
        self.data(kind, namespace, name).await
    }

    /// The services of `namespace`, for the link variables of a container's
    /// env; by default none.
    async fn services(&self, namespace: &str) -> Result<Vec<k8s_openapi::api::core::v1::Service>, ApiError> {
        let _ = namespace;
        Ok(Vec::new())
    }
}

/// The services whose link variables `pod`'s containers get, as upstream
/// chooses them: those of the pod's namespace when it enables service
/// links (the default), and the API server's own `kubernetes` service of
/// `default` always. A listing that fails is logged and gives none (a
/// container does not wait on it).
pub(crate) async fn link_services(objects: &dyn ApiObjects, pod: &Pod) -> Vec<k8s_openapi::api::core::v1::Service> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let links = pod.spec.as_ref().and_then(|s| s.enable_service_links).unwrap_or(true);
    let mut chosen: BTreeMap<String, k8s_openapi::api::core::v1::Service> = BTreeMap::new();
    let list = |namespace: &str, services: Result<Vec<k8s_openapi::api::core::v1::Service>, ApiError>| match services {
        Ok(services) => services,
        Err(error) => {
            tracing::warn!(%namespace, %error, "cannot list services for the containers' link variables");
            Vec::new()
        }
    };
    for service in list("default", objects.services("default").await) {
        if service.metadata.name.as_deref() == Some("kubernetes") {
            chosen.insert("kubernetes".into(), service);
        }
    }
    if links {
        for service in list(namespace, objects.services(namespace).await) {
            chosen.insert(service.metadata.name.clone().unwrap_or_default(), service);
        }
    }
    chosen.into_values().collect()
}

/// How a volume's objects are read.
#[derive(Clone, Copy)]
pub(crate) enum Read {
    /// A pod's start: [`ApiObjects::data_current`].
    Start,
    /// The periodic rewrite: [`ApiObjects::data_cached`], a copy at most
    /// this old.
    Rewrite(std::time::Duration),
}

/// Objects read as `read` says (tokens as always).
pub(crate) struct ReadObjects {
    /// Where the objects come from.
    pub objects: std::sync::Arc<dyn ApiObjects>,
    /// How.
    pub read: Read,
}

#[async_trait::async_trait]
impl ApiObjects for ReadObjects {
    async fn data(
        &self,
        kind: ObjectKind,
        namespace: &str,
        name: &str,
    ) -> Result<Option<BTreeMap<String, Vec<u8>>>, ApiError> {
        match self.read {
            Read::Start => self.objects.data_current(kind, namespace, name).await,
            Read::Rewrite(max_age) => self.objects.data_cached(kind, namespace, name, max_age).await,
        }
    }

    async fn service_account_token(
        &self,
        pod: &Pod,
        audience: Option<&str>,
        expiration_seconds: i64,
    ) -> Result<String, ApiError> {
        self.objects.service_account_token(pod, audience, expiration_seconds).await
    }
}

fn invalid(volume: &str, reason: String) -> VolumeError {
    VolumeError::InvalidSpec { volume: volume.to_owned(), reason }
}

/// A reference to a ConfigMap or Secret, from a volume or a projection.
struct ObjectRef<'a> {
    kind: ObjectKind,
    name: &'a str,
    items: Option<&'a [KeyToPath]>,
    optional: Option<bool>,
}

impl<'a> ObjectRef<'a> {
    fn new(kind: ObjectKind, name: &'a str, items: &'a Option<Vec<KeyToPath>>, optional: Option<bool>) -> Self {
        ObjectRef { kind, name, items: items.as_deref(), optional }
    }
}

/// The files of one object source (a configMap or secret volume, or a
/// projection of one).
async fn object_files(
    objects: &dyn ApiObjects,
    volume: &str,
    namespace: &str,
    source: ObjectRef<'_>,
    default_mode: u32,
) -> Result<Payload, VolumeError> {
    let ObjectRef { kind, name, items, optional } = source;
    let optional = optional.unwrap_or(false);
    let data = objects.data(kind, namespace, name).await.map_err(|e| invalid(volume, e.to_string()))?;
    let Some(data) = data else {
        if optional {
            return Ok(Payload::new());
        }
        return Err(invalid(volume, format!("{} \"{name}\" not found", kind.noun())));
    };
    let mut files = Payload::new();
    match items {
        Some(items) if !items.is_empty() => {
            for item in items {
                match data.get(&item.key) {
                    Some(content) => {
                        let mode = item.mode.map_or(default_mode, |m| m as u32);
                        files.insert(item.path.clone(), FileData { content: content.clone(), mode });
                    }
                    None if optional => {}
                    None => {
                        return Err(invalid(
                            volume,
                            format!("key {:?} not found in {} {namespace}/{name}", item.key, kind.noun()),
                        ));
                    }
                }
            }
        }
        _ => {
            for (key, content) in data {
                files.insert(key, FileData { content, mode: default_mode });
            }
        }
    }
    Ok(files)
}

fn mode(mode: Option<i32>) -> u32 {
    mode.map_or(0o644, |m| m as u32)
}

/// Prepares a `configMap`, `secret` or `projected` volume of `pod` in `dir`
/// (or writes it again with what the objects hold now); its files belong
/// to `fs_group` when the pod has one.
pub(crate) async fn prepare(
    objects: &dyn ApiObjects,
    pod: &Pod,
    volume: &k8s_openapi::api::core::v1::Volume,
    dir: &Path,
    context: &DownwardContext,
    fs_group: Option<u32>,
) -> Result<PathBuf, VolumeError> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let name = volume.name.as_str();
    let object = volume
        .config_map
        .as_ref()
        .map(|c| ObjectRef::new(ObjectKind::ConfigMap, &c.name, &c.items, c.optional))
        .or_else(|| {
            let secret = volume.secret.as_ref()?;
            let name = secret.secret_name.as_deref().unwrap_or_default();
            Some(ObjectRef::new(ObjectKind::Secret, name, &secret.items, secret.optional))
        });
    let mut files = Payload::new();
    if let Some(object) = object {
        let default_mode = volume.config_map.as_ref().and_then(|c| c.default_mode);
        let default_mode = mode(default_mode.or_else(|| volume.secret.as_ref().and_then(|s| s.default_mode)));
        files = object_files(objects, name, namespace, object, default_mode).await?;
    } else if let Some(projected) = &volume.projected {
        let default_mode = mode(projected.default_mode);
        for source in projected.sources.iter().flatten() {
            files.extend(projection(objects, pod, name, namespace, source, default_mode, context).await?);
        }
    }
    super::atomic_writer::write(name, dir, &files, fs_group)?;
    Ok(dir.to_owned())
}

async fn projection(
    objects: &dyn ApiObjects,
    pod: &Pod,
    volume: &str,
    namespace: &str,
    source: &VolumeProjection,
    default_mode: u32,
    context: &DownwardContext,
) -> Result<Payload, VolumeError> {
    let object = source
        .config_map
        .as_ref()
        .map(|c| ObjectRef::new(ObjectKind::ConfigMap, &c.name, &c.items, c.optional))
        .or_else(|| source.secret.as_ref().map(|c| ObjectRef::new(ObjectKind::Secret, &c.name, &c.items, c.optional)));
    if let Some(object) = object {
        return object_files(objects, volume, namespace, object, default_mode).await;
    }
    if let Some(downward) = &source.downward_api {
        let items = downward.items.as_deref().unwrap_or_default();
        return super::downward_api::files(volume, items, pod, context, default_mode);
    }
    if let Some(token) = &source.service_account_token {
        let expiration = token.expiration_seconds.unwrap_or(3600);
        if expiration < 600 {
            return Err(invalid(volume, format!("expirationSeconds {expiration} is below the minimum of 600")));
        }
        let text = objects
            .service_account_token(pod, token.audience.as_deref(), expiration)
            .await
            .map_err(|e| invalid(volume, e.to_string()))?;
        let file = FileData { content: text.into_bytes(), mode: default_mode };
        return Ok(Payload::from([(token.path.clone(), file)]));
    }
    Ok(Payload::new())
}

/// The objects a container's env references, fetched: (kind, name) → data
/// (`None`: no such object).
pub type EnvObjects = BTreeMap<(ObjectKind, String), Option<BTreeMap<String, String>>>;

/// Fetches what `container`'s env and envFrom reference.
pub(crate) async fn env_objects(
    objects: &dyn ApiObjects,
    pod: &Pod,
    container: &k8s_openapi::api::core::v1::Container,
) -> Result<EnvObjects, ApiError> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut wanted = Vec::new();
    for var in container.env.iter().flatten() {
        if let Some(from) = &var.value_from {
            if let Some(r) = &from.config_map_key_ref {
                wanted.push((ObjectKind::ConfigMap, r.name.clone()));
            }
            if let Some(r) = &from.secret_key_ref {
                wanted.push((ObjectKind::Secret, r.name.clone()));
            }
        }
    }
    for from in container.env_from.iter().flatten() {
        if let Some(r) = &from.config_map_ref {
            wanted.push((ObjectKind::ConfigMap, r.name.clone()));
        }
        if let Some(r) = &from.secret_ref {
            wanted.push((ObjectKind::Secret, r.name.clone()));
        }
    }
    let mut found = EnvObjects::new();
    for (kind, name) in wanted {
        if found.contains_key(&(kind, name.clone())) {
            continue;
        }
        let data = objects
            .data_current(kind, namespace, &name)
            .await?
            .map(|data| data.into_iter().map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned())).collect());
        found.insert((kind, name), data);
    }
    Ok(found)
}

/// The docker configs of `pod`'s `imagePullSecrets` (`.dockerconfigjson`,
/// or a legacy `.dockercfg` wrapped as `{"auths": ...}`). A secret that
/// cannot be read is logged and skipped, as upstream does: the pull goes on
/// without it.
pub(crate) async fn pull_secrets(objects: &dyn ApiObjects, pod: &Pod) -> crate::provider::PullSecrets {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut configs = Vec::new();
    for reference in pod.spec.iter().flat_map(|s| s.image_pull_secrets.iter().flatten()) {
        let name = reference.name.as_str();
        match objects.data_current(ObjectKind::Secret, namespace, name).await {
            Ok(Some(data)) => {
                if let Some(config) = data.get(".dockerconfigjson") {
                    configs.push(config.clone());
                } else if let Some(legacy) = data.get(".dockercfg") {
                    let mut wrapped = b"{\"auths\":".to_vec();
                    wrapped.extend_from_slice(legacy);
                    wrapped.push(b'}');
                    configs.push(wrapped);
                } else {
                    tracing::warn!(secret = %name, %namespace, "image pull secret has no .dockerconfigjson or .dockercfg; pulling without it");
                }
            }
            Ok(None) => tracing::warn!(secret = %name, %namespace, "image pull secret not found; pulling without it"),
            Err(error) => {
                tracing::warn!(secret = %name, %namespace, %error, "cannot read image pull secret; pulling without it")
            }
        }
    }
    crate::provider::PullSecrets(configs)
}
