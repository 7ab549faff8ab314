//! A real OCI registry on loopback for pull tests: Debian's
//! `docker-registry` (distribution 2.8), started with a temp config and
//! storage dir on a free port, optionally with htpasswd basic auth.
//!
//! When `/usr/bin/docker-registry` is missing it is installed with
//! `apt-get install -y docker-registry` (as root, once per machine, under a
//! file lock so parallel tests install it once). [`Registry::start`] says
//! why when it cannot be had; tests skip with that reason unless
//! `RUSTLET_REQUIRE_REGISTRY=1` (set by `.ci/run`), where they fail.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::{OCI_IMAGE_MEDIA_TYPE, OciImageManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// The registry binary the Debian package installs.
pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";

/// Makes sure `docker-registry` is installed; the reason when it cannot be.
pub fn ensure_installed() -> Result<PathBuf, String> {
    crate::debian::ensure_installed(REGISTRY_BIN, "docker-registry")
}

/// A running registry.
pub struct Registry {
    child: Option<tokio::process::Child>,
    /// Where it listens.
    pub address: SocketAddr,
    dir: tempfile::TempDir,
    /// `user:password` it requires, if any.
    pub credentials: Option<(String, String)>,
}

impl Registry {
    /// Starts a registry with anonymous access.
    pub async fn start() -> Result<Registry, String> {
        Self::start_with(None).await
    }

    /// Starts a registry that requires `user`/`password` (htpasswd).
    pub async fn start_with_auth(user: &str, password: &str) -> Result<Registry, String> {
        Self::start_with(Some((user.to_owned(), password.to_owned()))).await
    }

    async fn start_with(credentials: Option<(String, String)>) -> Result<Registry, String> {
        ensure_installed()?;
        let dir = tempfile::Builder::new().prefix("rustlet-registry-").tempdir().map_err(|e| e.to_string())?;
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
        let address = SocketAddr::from(([127, 0, 0, 1], port));
        let mut config = format!(
            "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {address}\n  secret: rustlet-tests\n",
            dir.path().join("data").display()
        );
        if let Some((user, password)) = &credentials {
            let hash = bcrypt::hash(password, 4).map_err(|e| e.to_string())?;
            let htpasswd = dir.path().join("htpasswd");
            std::fs::write(&htpasswd, format!("{user}:{hash}\n")).map_err(|e| e.to_string())?;
            config
                .push_str(&format!("auth:\n  htpasswd:\n    realm: rustlet-tests\n    path: {}\n", htpasswd.display()));
        }
        std::fs::write(dir.path().join("config.yml"), config).map_err(|e| e.to_string())?;
        let mut registry = Registry { child: None, address, dir, credentials };
        registry.restart().await?;
        Ok(registry)
    }

    /// Starts the registry process again (after [`Registry::stop`]), on the
    /// same port with the same storage.
    pub async fn restart(&mut self) -> Result<(), String> {
        let log_path = self.dir.path().join("registry.log");
        let mut child = tokio::process::Command::new(REGISTRY_BIN)
            .arg("serve")
            .arg(self.dir.path().join("config.yml"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("run {REGISTRY_BIN}: {e}"))?;
        let (ready_tx, ready) = tokio::sync::oneshot::channel::<()>();
        let mut ready_tx = Some(ready_tx);
        let log =
            tokio::fs::OpenOptions::new().create(true).append(true).open(&log_path).await.map_err(|e| e.to_string())?;
        let log = std::sync::Arc::new(tokio::sync::Mutex::new(log));
        let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
        for stream in [
            child.stdout.take().map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
            child.stderr.take().map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
        ]
        .into_iter()
        .flatten()
        {
            let lines_tx = lines_tx.clone();
            let log = log.clone();
            tokio::spawn(async move {
                let mut reader = BufReader::new(stream).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    let _ = log.lock().await.write_all(format!("{line}\n").as_bytes()).await;
                    let _ = lines_tx.send(line);
                }
            });
        }
        drop(lines_tx);
        tokio::spawn(async move {
            while let Some(line) = lines.recv().await {
                if line.contains("listening on")
                    && let Some(tx) = ready_tx.take()
                {
                    let _ = tx.send(());
                }
            }
        });
        match tokio::time::timeout(Duration::from_secs(60), ready).await {
            Ok(Ok(())) => {
                self.child = Some(child);
                Ok(())
            }
            _ => {
                let _ = child.kill().await;
                Err(format!(
                    "docker-registry did not start: {}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                ))
            }
        }
    }

    /// Stops the registry process (its storage stays).
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// `127.0.0.1:<port>`.
    pub fn host(&self) -> String {
        self.address.to_string()
    }

    /// `127.0.0.1:<port>/<repository>:<tag>`.
    pub fn reference(&self, repository: &str, tag: &str) -> String {
        format!("{}/{repository}:{tag}", self.host())
    }

    /// What the registry logged (its access log included).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// How many times blob `digest` was served (GET answered 200).
    pub fn blob_downloads(&self, digest: &str) -> usize {
        let wanted = format!("/blobs/{digest} ");
        self.log().lines().filter(|l| l.contains("\"GET ") && l.contains(&wanted) && l.contains("\" 200 ")).count()
    }

    /// Where the registry keeps blob `digest`'s bytes.
    pub fn blob_data(&self, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.dir.path().join("data/docker/registry/v2/blobs/sha256").join(&hex[..2]).join(hex).join("data")
    }

    /// The registry's storage root.
    pub fn storage(&self) -> &Path {
        self.dir.path()
    }

    fn auth(&self) -> RegistryAuth {
        match &self.credentials {
            Some((user, password)) => RegistryAuth::Basic(user.clone(), password.clone()),
            None => RegistryAuth::Anonymous,
        }
    }

    /// Pushes `module` as a CNCF wasm artifact (`application/wasm` layer)
    /// to `repository:tag`; returns the manifest and layer digests.
    pub async fn push_wasm(&self, repository: &str, tag: &str, module: &[u8]) -> Result<(String, String), String> {
        let layer = ImageLayer::new(module.to_vec(), "application/wasm".to_owned(), None);
        let os = if module.get(4) == Some(&0x0d) { "wasip2" } else { "wasip1" };
        let config = serde_json::json!({
            "created": "2026-01-01T00:00:00Z", "architecture": "wasm", "os": os,
            "layerDigests": [layer.sha256_digest()],
        });
        let config = Config::new(
            serde_json::to_vec(&config).map_err(|e| e.to_string())?,
            "application/vnd.wasm.config.v0+json".to_owned(),
            None,
        );
        self.push(repository, tag, vec![layer], config).await
    }

    /// Pushes `module` the wasm-to-oci way (Krustlet's media types).
    pub async fn push_wasm_to_oci(
        &self,
        repository: &str,
        tag: &str,
        module: &[u8],
    ) -> Result<(String, String), String> {
        let layer = ImageLayer::new(module.to_vec(), oci_client::manifest::WASM_LAYER_MEDIA_TYPE.to_owned(), None);
        let config = Config::new(b"{}".to_vec(), oci_client::manifest::WASM_CONFIG_MEDIA_TYPE.to_owned(), None);
        self.push(repository, tag, vec![layer], config).await
    }

    /// Pushes a plain single-layer image (`os`/`architecture` in its
    /// config) whose tar layer holds `files`, with `entrypoint`.
    pub async fn push_image(
        &self,
        repository: &str,
        tag: &str,
        os: &str,
        architecture: &str,
        files: &[(&str, &[u8])],
        entrypoint: &[&str],
    ) -> Result<(String, String), String> {
        let mut tar = tar::Builder::new(Vec::new());
        for (name, bytes) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o755);
            header.set_cksum();
            tar.append_data(&mut header, name, *bytes).map_err(|e| e.to_string())?;
        }
        let tar = tar.into_inner().map_err(|e| e.to_string())?;
        let diff_id = rustlet_wasi::store::digest_of(&tar);
        let layer = ImageLayer::new(tar, oci_client::manifest::IMAGE_LAYER_MEDIA_TYPE.to_owned(), None);
        let config = serde_json::json!({
            "architecture": architecture, "os": os,
            "config": {"Entrypoint": entrypoint},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        });
        let config = Config::oci_v1(serde_json::to_vec(&config).map_err(|e| e.to_string())?, None);
        self.push(repository, tag, vec![layer], config).await
    }

    /// Pushes a single-layer image: `layer` (an uncompressed tar) and the
    /// image config `config` (its `rootfs` is filled in here).
    pub async fn push_layer_image(
        &self,
        repository: &str,
        tag: &str,
        layer: Vec<u8>,
        mut config: serde_json::Value,
    ) -> Result<(String, String), String> {
        let diff_id = rustlet_wasi::store::digest_of(&layer);
        config["rootfs"] = serde_json::json!({"type": "layers", "diff_ids": [diff_id]});
        let layer = ImageLayer::new(layer, oci_client::manifest::IMAGE_LAYER_MEDIA_TYPE.to_owned(), None);
        let config = Config::oci_v1(serde_json::to_vec(&config).map_err(|e| e.to_string())?, None);
        self.push(repository, tag, vec![layer], config).await
    }

    async fn push(
        &self,
        repository: &str,
        tag: &str,
        layers: Vec<ImageLayer>,
        config: Config,
    ) -> Result<(String, String), String> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = Client::new(ClientConfig { protocol: ClientProtocol::Http, ..ClientConfig::default() });
        let reference: Reference = self.reference(repository, tag).parse().map_err(|e| format!("{e}"))?;
        let layer_digest = layers.first().map(|l| l.sha256_digest()).unwrap_or_default();
        let mut manifest = OciImageManifest::build(&layers, &config, None::<BTreeMap<String, String>>);
        manifest.media_type = Some(OCI_IMAGE_MEDIA_TYPE.to_owned());
        client.push(&reference, &layers, config, &self.auth(), Some(manifest)).await.map_err(|e| e.to_string())?;
        let digest = client.fetch_manifest_digest(&reference, &self.auth()).await.map_err(|e| e.to_string())?;
        Ok((digest, layer_digest))
    }
}

/// Starts a registry, or says why a test skips (and fails it when
/// `RUSTLET_REQUIRE_REGISTRY=1`).
pub async fn registry_or_skip(test: &str, credentials: Option<(&str, &str)>) -> Option<Registry> {
    let started = match credentials {
        Some((user, password)) => Registry::start_with_auth(user, password).await,
        None => Registry::start().await,
    };
    crate::skip::or_skip(test, crate::skip::Need::Registry, started)
}
