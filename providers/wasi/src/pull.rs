//! Pulling WebAssembly images from OCI registries into the [`ImageStore`].
//!
//! Accepted layouts:
//! - the CNCF wasm artifact: config `application/vnd.wasm.config.v0+json`,
//!   one layer `application/wasm`;
//! - wasm-to-oci (Krustlet's): a layer
//!   `application/vnd.wasm.content.layer.v1+wasm`;
//! - a plain image whose config says `architecture: wasm`, with one tar
//!   layer (gzip or not) holding the module named by `Entrypoint[0]` (or its
//!   only `.wasm` file).
//!
//! An image index is resolved to its wasm entry. Anything else, an ordinary
//! Linux image above all, is refused with a message saying what it is.

use kubelet_api::uds::error_chain;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{DigestError, OciDistributionError, OciErrorCode};
use oci_client::manifest::{OciDescriptor, OciImageManifest, OciManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use crate::store::{ImageRecord, ImageStore, ModuleKind};

/// The CNCF wasm artifact's config media type.
pub(crate) const WASM_CONFIG_V0: &str = "application/vnd.wasm.config.v0+json";
/// The CNCF wasm artifact's layer media type.
pub(crate) const WASM_LAYER: &str = "application/wasm";
/// wasm-to-oci's layer media type.
pub(crate) const WASM_TO_OCI_LAYER: &str = "application/vnd.wasm.content.layer.v1+wasm";
/// The component layer media type some tools use.
pub(crate) const WASM_COMPONENT_LAYER: &str = "application/vnd.bytecodealliance.wasm.component.layer.v0+wasm";

/// Why a pull failed, by what the user should look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PullErrorKind {
    /// No such repository, tag or digest.
    NotFound,
    /// The registry wants credentials (or refused the ones given).
    Unauthorized,
    /// The registry could not be reached.
    Unreachable,
    /// What the registry sent does not match its digest.
    DigestMismatch,
    /// The image is not a WebAssembly image.
    NotWasm,
    /// `imagePullPolicy: Never` and the image is not in the store.
    NeverPull,
    /// Anything else.
    Other,
}

/// A failed pull.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct PullError {
    /// What kind of failure.
    pub(crate) kind: PullErrorKind,
    /// What happened, naming the image.
    pub message: String,
}

impl PullError {
    fn new(kind: PullErrorKind, message: impl Into<String>) -> Self {
        PullError { kind, message: message.into() }
    }
}

pub use kubelet_provider::PullPolicy;

/// Parses an image reference (`docker.io/library/` is implied as upstream).
pub(crate) fn parse_reference(image: &str) -> Result<Reference, PullError> {
    image
        .parse::<Reference>()
        .map_err(|e| PullError::new(PullErrorKind::Other, format!("invalid image reference {image:?}: {e}")))
}

/// Credentials for registries, from a docker `config.json`
/// (`{"auths": {"host[:port]": {"auth": base64(user:password)}}}`, or
/// `username`/`password`, or `registrytoken` for a bearer token).
#[derive(Clone, Debug, Default)]
pub(crate) struct Credentials {
    by_registry: HashMap<String, RegistryAuth>,
}

#[derive(serde::Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: HashMap<String, DockerAuth>,
}

#[derive(serde::Deserialize)]
struct DockerAuth {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
    registrytoken: Option<String>,
}

/// Why registry credentials could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CredentialsError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// The file's content is wrong.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        source: Box<CredentialsError>,
    },
    /// Not a docker config (JSON with `auths`).
    #[error("{0}")]
    Json(String),
    /// A registry's `auth` is not base64 of `user:password`.
    #[error("auths.{registry}.auth: {reason}")]
    Auth {
        /// The registry's key in `auths`.
        registry: String,
        /// What is wrong.
        reason: String,
    },
}

impl Credentials {
    /// Reads `path`; a missing file means no credentials.
    pub(crate) fn load(path: &Path) -> Result<Credentials, CredentialsError> {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Credentials::default()),
            Err(source) => return Err(CredentialsError::Read { path: path.to_owned(), source }),
        };
        Self::parse(&bytes).map_err(|e| CredentialsError::File { path: path.to_owned(), source: Box::new(e) })
    }

    /// Parses a docker `config.json`.
    pub(crate) fn parse(bytes: &[u8]) -> Result<Credentials, CredentialsError> {
        use base64::Engine as _;
        let config: DockerConfig = serde_json::from_slice(bytes).map_err(|e| CredentialsError::Json(e.to_string()))?;
        let mut by_registry = HashMap::new();
        for (key, entry) in config.auths {
            // Keys may be URLs (`https://index.docker.io/v1/`).
            let host = key.trim_start_matches("https://").trim_start_matches("http://");
            let host = host.split('/').next().unwrap_or(host).to_owned();
            let auth = if let Some(token) = entry.registrytoken {
                RegistryAuth::Bearer(token)
            } else if let (Some(user), Some(password)) = (entry.username, entry.password) {
                RegistryAuth::Basic(user, password)
            } else if let Some(encoded) = entry.auth {
                let wrong = |reason: String| CredentialsError::Auth { registry: key.clone(), reason };
                let decoded = base64::engine::general_purpose::STANDARD
                    .decode(encoded.trim())
                    .map_err(|e| wrong(e.to_string()))?;
                let decoded = String::from_utf8(decoded).map_err(|e| wrong(e.to_string()))?;
                let (user, password) = decoded.split_once(':').ok_or_else(|| wrong("not user:password".into()))?;
                RegistryAuth::Basic(user.to_owned(), password.to_owned())
            } else {
                continue;
            };
            by_registry.insert(host, auth);
        }
        Ok(Credentials { by_registry })
    }

    /// Adds `other`'s registries that this one does not have.
    pub(crate) fn fill_from(&mut self, other: Credentials) {
        for (registry, auth) in other.by_registry {
            self.by_registry.entry(registry).or_insert(auth);
        }
    }

    /// The credentials for `registry` (`host[:port]`).
    pub(crate) fn for_registry(&self, registry: &str) -> RegistryAuth {
        let key = if registry == "docker.io" { "index.docker.io" } else { registry };
        self.by_registry.get(key).or_else(|| self.by_registry.get(registry)).cloned().unwrap_or(RegistryAuth::Anonymous)
    }
}

/// A short digest of credentials, to tell pulls with different ones apart
/// without keeping them in a key.
fn fingerprint(auth: &RegistryAuth) -> String {
    use sha2::Digest as _;
    let text = match auth {
        RegistryAuth::Anonymous => return "anonymous".to_owned(),
        RegistryAuth::Basic(user, password) => format!("basic\0{user}\0{password}"),
        RegistryAuth::Bearer(token) => format!("bearer\0{token}"),
    };
    sha2::Sha256::digest(text.as_bytes()).iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Plain HTTP for loopback registries (as containerd does for localhost),
/// HTTPS elsewhere.
fn is_loopback(registry: &str) -> bool {
    let host = match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.rsplit_once(':').map_or(registry, |(h, _)| h),
    };
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

type Flight = Arc<tokio::sync::Mutex<Option<(Instant, Result<ImageRecord, PullError>)>>>;

/// Pulls images into the store; concurrent pulls of one reference are one
/// pull.
pub struct Puller {
    store: ImageStore,
    credentials_file: PathBuf,
    flights: Mutex<HashMap<String, Flight>>,
    /// Connection and read timeout for registry requests.
    pub timeout: Duration,
    /// How many pulls reached a registry (for tests and metrics).
    pulls: std::sync::atomic::AtomicU64,
}

impl Puller {
    /// A puller into `store`, with credentials from `credentials_file` (a
    /// docker `config.json`, read at each pull).
    pub fn new(store: ImageStore, credentials_file: PathBuf) -> Puller {
        Puller {
            store,
            credentials_file,
            flights: Mutex::new(HashMap::new()),
            timeout: Duration::from_secs(30),
            pulls: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// How many pulls reached a registry so far.
    pub(crate) fn pull_count(&self) -> u64 {
        self.pulls.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Makes `image` present under `policy`; returns its record.
    pub async fn ensure(&self, image: &str, policy: PullPolicy) -> Result<ImageRecord, PullError> {
        self.ensure_with(image, policy, Credentials::default()).await
    }

    /// [`Puller::ensure`] with `credentials` (a pod's pull secrets) before
    /// the node's own. Pulls of one image share one flight: a pull already
    /// running goes on with the credentials it started with.
    pub(crate) async fn ensure_with(
        &self,
        image: &str,
        policy: PullPolicy,
        credentials: Credentials,
    ) -> Result<ImageRecord, PullError> {
        let reference = parse_reference(image)?;
        let name = reference.whole();
        let stored = self.store.get(&name).map_err(|e| PullError::new(PullErrorKind::Other, e.to_string()))?;
        match (policy, stored) {
            (PullPolicy::Never, Some(record)) | (PullPolicy::IfNotPresent, Some(record)) => Ok(record),
            (PullPolicy::Never, None) => Err(PullError::new(
                PullErrorKind::NeverPull,
                format!("Container image \"{image}\" is not present with pull policy of Never"),
            )),
            _ => {
                let mut credentials = credentials;
                let file = Credentials::load(&self.credentials_file)
                    .map_err(|e| PullError::new(PullErrorKind::Other, format!("registry credentials: {e}")))?;
                credentials.fill_from(file);
                self.pull_once(&reference, credentials.for_registry(reference.registry())).await
            }
        }
    }

    /// Pulls `reference` with `auth`, sharing the pull with callers that
    /// arrive while it runs with the same credentials (another pod's
    /// credentials are another pull: its own may be refused).
    async fn pull_once(&self, reference: &Reference, auth: RegistryAuth) -> Result<ImageRecord, PullError> {
        let asked = Instant::now();
        let name = format!("{}|{}", reference.whole(), fingerprint(&auth));
        let flight = crate::lock(&self.flights).entry(name.clone()).or_default().clone();
        let mut slot = flight.lock().await;
        if let Some((finished, result)) = slot.as_ref()
            && *finished >= asked
        {
            return result.clone();
        }
        let result = self.pull(reference, &auth).await;
        *slot = Some((Instant::now(), result.clone()));
        drop(slot);
        // Forget the flight when nobody else waits on it.
        let mut flights = crate::lock(&self.flights);
        if flights.get(&name).is_some_and(|f| Arc::strong_count(f) <= 2) {
            flights.remove(&name);
        }
        result
    }

    fn client(&self, reference: &Reference) -> Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let protocol =
            if is_loopback(reference.resolve_registry()) { ClientProtocol::Http } else { ClientProtocol::Https };
        Client::new(ClientConfig {
            protocol,
            connect_timeout: Some(self.timeout),
            read_timeout: Some(self.timeout),
            ..ClientConfig::default()
        })
    }

    /// Pulls `reference` from its registry.
    async fn pull(&self, reference: &Reference, auth: &RegistryAuth) -> Result<ImageRecord, PullError> {
        self.pulls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let image = reference.whole();
        let fail = |e: OciDistributionError| classify(&image, e);
        let client = self.client(reference);
        tracing::info!(%image, "pulling image");
        let (manifest, digest) = client.pull_manifest(reference, auth).await.map_err(fail)?;
        let (manifest, digest) = match manifest {
            OciManifest::Image(manifest) => (manifest, digest),
            OciManifest::ImageIndex(index) => {
                let entry = index.manifests.iter().find(|e| e.platform.as_ref().is_some_and(is_wasm_platform));
                let Some(entry) = entry else {
                    let platforms: Vec<String> = index
                        .manifests
                        .iter()
                        .filter_map(|e| e.platform.as_ref().map(|p| format!("{}/{}", p.os, p.architecture)))
                        .collect();
                    return Err(not_wasm(&image, &format!("an image index for {}", platforms.join(", "))));
                };
                let by_digest = reference.clone_with_digest(entry.digest.clone());
                match client.pull_manifest(&by_digest, auth).await.map_err(fail)? {
                    (OciManifest::Image(manifest), digest) => (manifest, digest),
                    (OciManifest::ImageIndex(_), _) => {
                        return Err(not_wasm(&image, "an image index nested in an image index"));
                    }
                }
            }
        };
        let now = Timestamp::now();
        // The same manifest is already here (under this or another name).
        if let Some(known) =
            self.store.by_id(&digest).map_err(|e| PullError::new(PullErrorKind::Other, e.to_string()))?
        {
            let record = ImageRecord { name: image.clone(), last_used: now, ..known };
            self.store.put(record.clone()).map_err(|e| PullError::new(PullErrorKind::Other, e.to_string()))?;
            tracing::info!(%image, id = %digest, "image is up to date");
            return Ok(record);
        }
        let (layer, format) = wasm_layer(&image, &manifest)?;
        let (module, kind, size, default_args) = match layer {
            Some(layer) => {
                let (module, kind, size) = self.fetch_module(&client, reference, auth, layer).await?;
                (module, kind, size, Vec::new())
            }
            None => self.fetch_from_image(&client, reference, auth, &manifest).await?,
        };
        let record = ImageRecord {
            name: image.clone(),
            id: digest,
            module,
            kind,
            size,
            format: format.to_owned(),
            default_args,
            imported: false,
            created: now,
            last_used: now,
        };
        self.store.put(record.clone()).map_err(|e| PullError::new(PullErrorKind::Other, e.to_string()))?;
        tracing::info!(%image, id = %record.id, size, "image pulled");
        Ok(record)
    }

    /// Downloads `layer` into a temp file (oci-client checks its digest),
    /// then moves it into the store once it is a wasm binary.
    async fn fetch_blob(
        &self,
        client: &Client,
        reference: &Reference,
        layer: &OciDescriptor,
    ) -> Result<PathBuf, PullError> {
        let image = reference.whole();
        let temp = self.store.temp_path(&layer.digest);
        let file = tokio::fs::File::create(&temp)
            .await
            .map_err(|e| PullError::new(PullErrorKind::Other, format!("{}: {e}", temp.display())))?;
        let mut file = tokio::io::BufWriter::new(file);
        let pulled = client.pull_blob(reference, layer, &mut file).await;
        let flushed = tokio::io::AsyncWriteExt::flush(&mut file).await;
        if let Err(e) = pulled {
            let _ = tokio::fs::remove_file(&temp).await;
            return Err(classify(&image, e));
        }
        if let Err(e) = flushed {
            let _ = tokio::fs::remove_file(&temp).await;
            return Err(PullError::new(PullErrorKind::Other, format!("{}: {e}", temp.display())));
        }
        Ok(temp)
    }

    async fn fetch_module(
        &self,
        client: &Client,
        reference: &Reference,
        auth: &RegistryAuth,
        layer: &OciDescriptor,
    ) -> Result<(String, ModuleKind, u64), PullError> {
        let image = reference.whole();
        // Authenticates the blob requests that follow.
        client.store_auth_if_needed(reference.resolve_registry(), auth).await;
        if self.store.has_blob(&layer.digest) {
            let bytes =
                self.store.read_blob(&layer.digest).map_err(|e| PullError::new(PullErrorKind::Other, e.to_string()))?;
            let kind = ModuleKind::detect(&bytes).ok_or_else(|| not_a_module(&image, &layer.digest))?;
            return Ok((layer.digest.clone(), kind, bytes.len() as u64));
        }
        let temp = self.fetch_blob(client, reference, layer).await?;
        let mut header = [0u8; 8];
        let read = std::fs::File::open(&temp).and_then(|mut f| f.read_exact(&mut header));
        let Some(kind) = read.ok().and_then(|()| ModuleKind::detect(&header)) else {
            let _ = std::fs::remove_file(&temp);
            return Err(not_a_module(&image, &layer.digest));
        };
        let size = std::fs::metadata(&temp).map(|m| m.len()).unwrap_or_default();
        let path = self.store.blob_path(&layer.digest);
        std::fs::rename(&temp, &path)
            .map_err(|e| PullError::new(PullErrorKind::Other, format!("{}: {e}", path.display())))?;
        Ok((layer.digest.clone(), kind, size))
    }

    /// A plain image: its config must say `architecture: wasm`; its one tar
    /// layer holds the module.
    async fn fetch_from_image(
        &self,
        client: &Client,
        reference: &Reference,
        auth: &RegistryAuth,
        manifest: &OciImageManifest,
    ) -> Result<(String, ModuleKind, u64, Vec<String>), PullError> {
        let image = reference.whole();
        client.store_auth_if_needed(reference.resolve_registry(), auth).await;
        let mut config = Vec::new();
        client.pull_blob(reference, &manifest.config, &mut config).await.map_err(|e| classify(&image, e))?;
        let (layer, default_args) = plain_image_layer(&image, &config, manifest)?;
        let temp = self.fetch_blob(client, reference, layer).await?;
        let gzip = layer.media_type.ends_with("gzip");
        let wanted = default_args.first().cloned();
        let extracted = tokio::task::spawn_blocking(move || {
            let result = extract_module(&temp, gzip, wanted.as_deref());
            let _ = std::fs::remove_file(&temp);
            result
        })
        .await
        .map_err(|e| PullError::new(PullErrorKind::Other, e.to_string()))?
        .map_err(|e| PullError::new(PullErrorKind::NotWasm, format!("image \"{image}\": {e}")))?;
        let kind = ModuleKind::detect(&extracted).ok_or_else(|| not_a_module(&image, &layer.digest))?;
        let module =
            self.store.write_blob(&extracted).map_err(|e| PullError::new(PullErrorKind::Other, e.to_string()))?;
        Ok((module, kind, extracted.len() as u64, default_args))
    }
}

/// An image index entry's platform that runs here (`wasm`, or a WASI os).
pub(crate) fn is_wasm_platform(platform: &oci_client::manifest::Platform) -> bool {
    platform.architecture.to_string() == "wasm"
        || matches!(platform.os.to_string().as_str(), "wasi" | "wasip1" | "wasip2")
}

/// A plain image (module in a tar layer): checks that its config (`config`,
/// the blob's bytes) says `architecture: wasm` and that it has one layer;
/// returns that layer and the image's `Entrypoint` + `Cmd`.
pub(crate) fn plain_image_layer<'m>(
    image: &str,
    config: &[u8],
    manifest: &'m OciImageManifest,
) -> Result<(&'m OciDescriptor, Vec<String>), PullError> {
    let config: ImageConfig = serde_json::from_slice(config).map_err(|e| {
        PullError::new(PullErrorKind::NotWasm, format!("image \"{image}\": its config is not an image config: {e}"))
    })?;
    if config.architecture != "wasm" {
        return Err(not_wasm(image, &format!("a {}/{} container image", config.os, config.architecture)));
    }
    let [layer] = manifest.layers.as_slice() else {
        return Err(not_wasm(
            image,
            &format!(
                "a wasm image with {} layers (Rustlet takes the module from a single layer)",
                manifest.layers.len()
            ),
        ));
    };
    let exec = config.config.unwrap_or_default();
    let mut args = exec.entrypoint.unwrap_or_default();
    args.extend(exec.cmd.unwrap_or_default());
    Ok((layer, args))
}

/// The subset of an OCI image config Rustlet reads.
#[derive(serde::Deserialize, Default)]
struct ImageConfig {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
    #[serde(default)]
    config: Option<ExecConfig>,
}

#[derive(serde::Deserialize, Default)]
struct ExecConfig {
    #[serde(rename = "Entrypoint", default)]
    entrypoint: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    cmd: Option<Vec<String>>,
}

/// The layer holding the module, and the format's name; `None` for a plain
/// image (the module is in a tar layer).
pub(crate) fn wasm_layer<'m>(
    image: &str,
    manifest: &'m OciImageManifest,
) -> Result<(Option<&'m OciDescriptor>, &'static str), PullError> {
    let wasm_layers: Vec<&OciDescriptor> = manifest
        .layers
        .iter()
        .filter(|l| matches!(l.media_type.as_str(), WASM_LAYER | WASM_TO_OCI_LAYER | WASM_COMPONENT_LAYER))
        .collect();
    let config_type = manifest.config.media_type.as_str();
    match (config_type, wasm_layers.as_slice()) {
        (WASM_CONFIG_V0, [layer]) if manifest.layers.len() == 1 => Ok((Some(layer), "wasm-artifact")),
        (WASM_CONFIG_V0, _) => Err(not_wasm(
            image,
            &format!("a wasm artifact with {} layers (the layout allows exactly one)", manifest.layers.len()),
        )),
        (_, [layer, ..]) if layer.media_type == WASM_TO_OCI_LAYER => Ok((Some(layer), "wasm-to-oci")),
        (_, [layer, ..]) => Ok((Some(layer), "wasm-artifact")),
        (oci_client::manifest::IMAGE_CONFIG_MEDIA_TYPE | oci_client::manifest::IMAGE_DOCKER_CONFIG_MEDIA_TYPE, []) => {
            Ok((None, "image-layer"))
        }
        (other, []) => {
            let layers: Vec<&str> = manifest.layers.iter().map(|l| l.media_type.as_str()).collect();
            Err(not_wasm(image, &format!("an artifact of type {other} with layers {layers:?}")))
        }
    }
}

/// Reads the module out of a tar layer: the file `wanted` (the image's
/// entrypoint), else the only `.wasm` file.
pub(crate) fn extract_module(path: &Path, gzip: bool, wanted: Option<&str>) -> Result<Vec<u8>, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let reader: Box<dyn Read> = if gzip { Box::new(flate2::read::GzDecoder::new(file)) } else { Box::new(file) };
    let mut archive = tar::Archive::new(reader);
    let wanted = wanted.map(|w| w.trim_start_matches('/').to_owned());
    let mut found: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in archive.entries().map_err(|e| format!("its layer is not a tar archive: {e}"))? {
        let mut entry = entry.map_err(|e| format!("its layer is not a tar archive: {e}"))?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let name = entry.path().map_err(|e| e.to_string())?.to_string_lossy().trim_start_matches("./").to_owned();
        let matches = match &wanted {
            Some(wanted) => &name == wanted,
            None => name.ends_with(".wasm"),
        };
        if matches {
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).map_err(|e| e.to_string())?;
            found.push((name, bytes));
        }
    }
    match (found.len(), wanted) {
        (1, _) => Ok(found.remove(0).1),
        (0, Some(wanted)) => Err(format!("its layer has no file /{wanted} (the image's entrypoint)")),
        (0, None) => Err("its layer has no .wasm file and the image names no entrypoint".into()),
        (_, _) => Err(format!(
            "its layer has several .wasm files ({}) and the image names no entrypoint",
            found.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
        )),
    }
}

fn not_wasm(image: &str, what: &str) -> PullError {
    PullError::new(
        PullErrorKind::NotWasm,
        format!(
            "image \"{image}\" is {what}, not a WebAssembly image: the wasi provider runs wasm modules \
             (OCI wasm artifacts, or images with architecture wasm); run Linux containers on a node with a container runtime"
        ),
    )
}

fn not_a_module(image: &str, digest: &str) -> PullError {
    PullError::new(
        PullErrorKind::NotWasm,
        format!("image \"{image}\": layer {digest} is not a WebAssembly binary (no \\0asm header)"),
    )
}

/// Turns an oci-client error into a message a user can act on.
fn classify(image: &str, error: OciDistributionError) -> PullError {
    use OciDistributionError as E;
    let any_code = |e: &oci_client::errors::OciEnvelope, wanted: fn(&OciErrorCode) -> bool| {
        e.errors.iter().any(|x| wanted(&x.code))
    };
    let (kind, what) = match &error {
        E::UnauthorizedError { .. } | E::AuthenticationFailure(_) | E::ServerError { code: 401 | 403, .. } => (
            PullErrorKind::Unauthorized,
            "the registry refused access (401 Unauthorized): check the credentials for it".to_owned(),
        ),
        E::RegistryError { envelope, .. }
            if any_code(envelope, |c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied)) =>
        {
            (PullErrorKind::Unauthorized, format!("the registry refused access: {error}"))
        }
        E::RegistryError { envelope, .. }
            if any_code(envelope, |c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NotFound
                )
            }) =>
        {
            (PullErrorKind::NotFound, "not found: no such repository, tag or digest in the registry".to_owned())
        }
        E::ServerError { code: 404, .. } | E::ImageManifestNotFoundError(_) => {
            (PullErrorKind::NotFound, format!("not found: {error}"))
        }
        E::DigestError(DigestError::VerificationError { expected, actual }) => (
            PullErrorKind::DigestMismatch,
            format!("digest mismatch: the registry sent content with digest {actual}, expected {expected}"),
        ),
        E::IoError(io) if io.get_ref().and_then(|i| i.downcast_ref::<DigestError>()).is_some() => {
            (PullErrorKind::DigestMismatch, format!("digest mismatch: {io}"))
        }
        E::RequestError(r) if r.is_connect() || r.is_timeout() => {
            (PullErrorKind::Unreachable, format!("the registry cannot be reached: {}", error_chain(r)))
        }
        _ => (PullErrorKind::Other, error_chain(&error)),
    };
    PullError::new(kind, format!("pulling image \"{image}\": {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_policy_defaults_follow_upstream() {
        assert_eq!(PullPolicy::of(None, "r.io/a/b"), PullPolicy::Always);
        assert_eq!(PullPolicy::of(None, "r.io/a/b:latest"), PullPolicy::Always);
        assert_eq!(PullPolicy::of(None, "localhost:5000/a/b"), PullPolicy::Always);
        assert_eq!(PullPolicy::of(None, "localhost:5000/a/b:v1"), PullPolicy::IfNotPresent);
        assert_eq!(PullPolicy::of(None, &format!("r.io/a@sha256:{}", "0".repeat(64))), PullPolicy::IfNotPresent);
        assert_eq!(PullPolicy::of(Some("Never"), "a:latest"), PullPolicy::Never);
        assert_eq!(PullPolicy::of(Some("Always"), "a:v1"), PullPolicy::Always);
    }

    #[test]
    fn docker_config_credentials() -> Result<(), CredentialsError> {
        let credentials = Credentials::parse(
            br#"{"auths": {
                "127.0.0.1:5000": {"auth": "dXNlcjpwYXNz"},
                "https://index.docker.io/v1/": {"username": "u", "password": "p"},
                "ghcr.io": {"registrytoken": "tok"}}}"#,
        )?;
        assert_eq!(credentials.for_registry("127.0.0.1:5000"), RegistryAuth::Basic("user".into(), "pass".into()));
        assert_eq!(credentials.for_registry("docker.io"), RegistryAuth::Basic("u".into(), "p".into()));
        assert_eq!(credentials.for_registry("ghcr.io"), RegistryAuth::Bearer("tok".into()));
        assert_eq!(credentials.for_registry("quay.io"), RegistryAuth::Anonymous);
        let refused = Credentials::parse(br#"{"auths": {"x": {"auth": "!!"}}}"#).expect_err("not base64");
        assert!(matches!(&refused, CredentialsError::Auth { registry, .. } if registry == "x"), "{refused}");
        Ok(())
    }

    #[test]
    fn loopback_registries_use_http() {
        assert!(is_loopback("127.0.0.1:5000"));
        assert!(is_loopback("localhost:5000"));
        assert!(is_loopback("[::1]:5000"));
        assert!(!is_loopback("ghcr.io"));
        assert!(!is_loopback("10.0.0.1:5000"));
    }
}
