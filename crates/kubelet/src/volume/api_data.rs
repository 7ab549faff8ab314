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
//! [`pull_secrets`] reads a pod's `imagePullSecrets` for its image pulls.
//!
//! Not done: refreshing the files when the objects change (upstream syncs
//! them about every minute), renewing tokens before they expire, secrets
//! on tmpfs (they are written to the pod's directory).

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{KeyToPath, Pod, VolumeProjection};

use super::VolumeError;

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
    ) -> Result<Option<BTreeMap<String, Vec<u8>>>, String>;

    /// A service-account token for `pod` (bound to it), for `audience` (the
    /// API server's when `None`), valid `expiration_seconds`.
    async fn service_account_token(
        &self,
        pod: &Pod,
        audience: Option<&str>,
        expiration_seconds: i64,
    ) -> Result<String, String>;
}

/// A file to write: relative path, content, mode.
struct File {
    path: String,
    content: Vec<u8>,
    mode: u32,
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
) -> Result<Vec<File>, VolumeError> {
    let ObjectRef { kind, name, items, optional } = source;
    let optional = optional.unwrap_or(false);
    let data = objects.data(kind, namespace, name).await.map_err(|e| invalid(volume, e))?;
    let Some(data) = data else {
        if optional {
            return Ok(Vec::new());
        }
        return Err(invalid(volume, format!("{} \"{name}\" not found", kind.noun())));
    };
    let mut files = Vec::new();
    match items {
        Some(items) if !items.is_empty() => {
            for item in items {
                match data.get(&item.key) {
                    Some(content) => files.push(File {
                        path: item.path.clone(),
                        content: content.clone(),
                        mode: item.mode.map_or(default_mode, |m| m as u32),
                    }),
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
                files.push(File { path: key, content, mode: default_mode });
            }
        }
    }
    Ok(files)
}

/// Writes `files` into `dir` (each whole, then renamed into place).
fn write_files(volume: &str, dir: &Path, files: &[File]) -> Result<(), VolumeError> {
    let io = |path: &Path, source: std::io::Error| VolumeError::Io {
        volume: volume.to_owned(),
        path: path.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    for file in files {
        if file.path.starts_with('/') || file.path.split('/').any(|part| part == ".." || part.is_empty()) {
            return Err(invalid(volume, format!("path {:?} must be relative and must not contain '..'", file.path)));
        }
        let target = dir.join(&file.path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
        }
        let partial = target.with_extension("partial");
        std::fs::write(&partial, &file.content).map_err(|e| io(&partial, e))?;
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(file.mode & 0o777))
            .map_err(|e| io(&partial, e))?;
        std::fs::rename(&partial, &target).map_err(|e| io(&target, e))?;
    }
    Ok(())
}

fn mode(mode: Option<i32>) -> u32 {
    mode.map_or(0o644, |m| m as u32)
}

/// Prepares a `configMap`, `secret` or `projected` volume of `pod` in `dir`.
pub async fn prepare(
    objects: &dyn ApiObjects,
    pod: &Pod,
    volume: &k8s_openapi::api::core::v1::Volume,
    dir: &Path,
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
    let mut files = Vec::new();
    if let Some(object) = object {
        let default_mode = volume.config_map.as_ref().and_then(|c| c.default_mode);
        let default_mode = mode(default_mode.or_else(|| volume.secret.as_ref().and_then(|s| s.default_mode)));
        files = object_files(objects, name, namespace, object, default_mode).await?;
    } else if let Some(projected) = &volume.projected {
        let default_mode = mode(projected.default_mode);
        for source in projected.sources.iter().flatten() {
            files.extend(projection(objects, pod, name, namespace, source, default_mode).await?);
        }
    }
    write_files(name, dir, &files)?;
    Ok(dir.to_owned())
}

async fn projection(
    objects: &dyn ApiObjects,
    pod: &Pod,
    volume: &str,
    namespace: &str,
    source: &VolumeProjection,
    default_mode: u32,
) -> Result<Vec<File>, VolumeError> {
    let object = source
        .config_map
        .as_ref()
        .map(|c| ObjectRef::new(ObjectKind::ConfigMap, &c.name, &c.items, c.optional))
        .or_else(|| source.secret.as_ref().map(|c| ObjectRef::new(ObjectKind::Secret, &c.name, &c.items, c.optional)));
    if let Some(object) = object {
        return object_files(objects, volume, namespace, object, default_mode).await;
    }
    if let Some(downward) = &source.downward_api {
        let mut files = Vec::new();
        for item in downward.items.iter().flatten() {
            let field = item.field_ref.as_ref().ok_or_else(|| {
                invalid(volume, format!("item {:?}: only fieldRef is supported in projections", item.path))
            })?;
            let value = super::field_value(pod, &field.field_path)
                .ok_or_else(|| invalid(volume, format!("unsupported fieldRef {:?}", field.field_path)))?;
            files.push(File { path: item.path.clone(), content: value.into_bytes(), mode: mode(item.mode) });
        }
        return Ok(files);
    }
    if let Some(token) = &source.service_account_token {
        let expiration = token.expiration_seconds.unwrap_or(3600);
        if expiration < 600 {
            return Err(invalid(volume, format!("expirationSeconds {expiration} is below the minimum of 600")));
        }
        let text = objects
            .service_account_token(pod, token.audience.as_deref(), expiration)
            .await
            .map_err(|e| invalid(volume, e))?;
        return Ok(vec![File { path: token.path.clone(), content: text.into_bytes(), mode: default_mode }]);
    }
    Ok(Vec::new())
}

/// The objects a container's env references, fetched: (kind, name) → data
/// (`None`: no such object).
pub type EnvObjects = BTreeMap<(ObjectKind, String), Option<BTreeMap<String, String>>>;

/// Fetches what `container`'s env and envFrom reference.
pub async fn env_objects(
    objects: &dyn ApiObjects,
    pod: &Pod,
    container: &k8s_openapi::api::core::v1::Container,
) -> Result<EnvObjects, String> {
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
            .data(kind, namespace, &name)
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
pub async fn pull_secrets(objects: &dyn ApiObjects, pod: &Pod) -> crate::provider::PullSecrets {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut configs = Vec::new();
    for reference in pod.spec.iter().flat_map(|s| s.image_pull_secrets.iter().flatten()) {
        let name = reference.name.as_str();
        match objects.data(ObjectKind::Secret, namespace, name).await {
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
