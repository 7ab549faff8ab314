//! TLS bootstrap and certificate rotation, as the kubelet does them.
//!
//! - **Bootstrap** (`--bootstrap-kubeconfig`): while `--kubeconfig` has no
//!   valid client certificate, the node makes an ECDSA P-256 key and asks
//!   the cluster for a certificate with a CertificateSigningRequest (signer
//!   `kubernetes.io/kube-apiserver-client-kubelet`, CN `system:node:<node>`,
//!   O `system:nodes`, usages digital signature and client auth), using the
//!   bootstrap identity (a bootstrap token, say). Once the CSR is approved
//!   (kube-controller-manager's csrapproving controller does it for
//!   `system:bootstrappers` given upstream's RBAC bindings) and signed, the
//!   key and certificate go to `<cert-dir>/kubelet-client-<time>.pem`, the
//!   link `kubelet-client-current.pem` points at it, and `--kubeconfig` is
//!   written to use it. A restart reuses them while they are valid.
//! - **Rotation** (`--rotate-certificates`): at 70–90% of the certificate's
//!   lifetime (counted from when the node got it: signers backdate
//!   `notBefore`), the node asks again with its own identity. Once the new
//!   certificate is written, requests go out on a new HTTP client (new
//!   connections with the new certificate); requests under way, watches
//!   included, finish on the old client's connections, which close when
//!   nothing uses them. Nothing waits or fails for the switch (the API
//!   server checks a client certificate when a request starts, so a watch
//!   begun under the old one runs on). A failed renewal is retried with
//!   backoff while the old certificate is valid.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{CertificateSigningRequest, CertificateSigningRequestSpec};
use kube::api::{Api, PostParams};
use kube::client::ConfigExt as _;
use tokio_util::sync::CancellationToken;

use crate::pki::tls::write_private;
use crate::pki::x509::certificate_facts;

/// The signer of kubelet client certificates.
pub(crate) const CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";
/// The signer of kubelet serving certificates.
pub const SERVING_SIGNER: &str = "kubernetes.io/kubelet-serving";

/// TLS bootstrap and rotation settings.
#[derive(Clone, Debug)]
pub struct BootstrapSettings {
    /// The kubeconfig the node uses (`--kubeconfig`); written by the
    /// bootstrap.
    pub kubeconfig: PathBuf,
    /// The kubeconfig with the bootstrap identity (`--bootstrap-kubeconfig`);
    /// `None`: no bootstrap, `kubeconfig` must work as it is.
    pub bootstrap_kubeconfig: Option<PathBuf>,
    /// Where keys and certificates are kept (`--cert-dir`).
    pub cert_dir: PathBuf,
    /// Renew the client certificate before it expires
    /// (`--rotate-certificates`).
    pub rotate: bool,
}

/// Why a certificate could not be had.
#[derive(Debug, thiserror::Error)]
pub enum CertificateError {
    /// A kubeconfig could not be read or used.
    #[error("{path}: {reason}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file could not be written.
    #[error("{0}")]
    Files(#[from] crate::pki::tls::TlsError),
    /// The request could not be made or sent.
    #[error("certificate signing request: {0}")]
    Request(String),
    /// The cluster refused it.
    #[error("certificate signing request {name} was {outcome}: {message}")]
    Refused {
        /// The CSR's name.
        name: String,
        /// Denied or Failed.
        outcome: String,
        /// The condition's message.
        message: String,
    },
}

/// A certificate and its key as PEM, with its validity. Its `Debug` shows
/// no key (logs and panics must not carry it).
#[derive(Clone)]
pub struct IssuedCertificate {
    /// The certificate chain (PEM).
    pub cert_pem: String,
    /// The private key (PEM).
    pub key_pem: String,
    /// When the node got it (or its `notBefore`, if later).
    pub issued: jiff::Timestamp,
    /// Its `notAfter`.
    pub not_after: jiff::Timestamp,
}

impl std::fmt::Debug for IssuedCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedCertificate")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .field("issued", &self.issued)
            .field("not_after", &self.not_after)
            .finish()
    }
}

impl IssuedCertificate {
    /// When to renew it: 70–90% (random) of its lifetime after it was had.
    pub(crate) fn renew_at(&self) -> jiff::Timestamp {
        let lifetime = self.not_after.duration_since(self.issued);
        let fraction = 0.7 + 0.2 * random_unit();
        let after = jiff::SignedDuration::from_secs_f64(lifetime.as_secs_f64().max(0.0) * fraction);
        self.issued + after
    }

    fn from_pem(cert_pem: String, key_pem: String, received: jiff::Timestamp) -> Result<Self, CertificateError> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject as _;
        let leaf = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .next()
            .ok_or_else(|| CertificateError::Request("the issued certificate holds no CERTIFICATE block".into()))?
            .map_err(|e| CertificateError::Request(format!("the issued certificate is not PEM: {e}")))?;
        let facts = certificate_facts(&leaf).map_err(|e| CertificateError::Request(e.to_string()))?;
        Ok(IssuedCertificate { cert_pem, key_pem, issued: received.max(facts.not_before), not_after: facts.not_after })
    }
}

/// A number in [0, 1).
fn random_unit() -> f64 {
    (uuid::Uuid::new_v4().as_u128() >> 75) as f64 / (1u64 << 53) as f64
}

/// What a certificate is asked for.
pub struct Request<'a> {
    /// The signer.
    pub signer: &'a str,
    /// The node's name (the subject is `system:node:<node>` in
    /// `system:nodes`).
    pub node_name: &'a str,
    /// DNS names (serving certificates).
    pub dns_names: Vec<String>,
    /// IP addresses (serving certificates).
    pub ips: Vec<std::net::IpAddr>,
    /// The key usages, in the API's words.
    pub usages: &'a [&'a str],
}

/// How long a CSR is waited on before it is given up and asked again
/// (upstream's).
pub(crate) const CSR_DEADLINE: Duration = Duration::from_secs(15 * 60);

/// `request_certificate` given up after [`CSR_DEADLINE`].
pub async fn request_certificate_within(
    client: &kube::Client,
    request: &Request<'_>,
    shutdown: &CancellationToken,
) -> Result<Option<IssuedCertificate>, CertificateError> {
    tokio::time::timeout(CSR_DEADLINE, request_certificate(client, request, shutdown)).await.unwrap_or_else(|_| {
        Err(CertificateError::Request(format!(
            "not approved and signed within {} minutes; asking again",
            CSR_DEADLINE.as_secs() / 60
        )))
    })
}

/// Asks the cluster for a certificate with a new ECDSA P-256 key and waits
/// until it is issued (or refused, or `shutdown`).
pub(crate) async fn request_certificate(
    client: &kube::Client,
    request: &Request<'_>,
    shutdown: &CancellationToken,
) -> Result<Option<IssuedCertificate>, CertificateError> {
    let fail = |e: &dyn std::fmt::Display| CertificateError::Request(e.to_string());
    let key = rcgen::KeyPair::generate().map_err(|e| fail(&e))?;
    let mut params = rcgen::CertificateParams::new(request.dns_names.clone()).map_err(|e| fail(&e))?;
    params.subject_alt_names.extend(request.ips.iter().map(|ip| rcgen::SanType::IpAddress(*ip)));
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(rcgen::DnType::OrganizationName, "system:nodes");
    params.distinguished_name.push(rcgen::DnType::CommonName, format!("system:node:{}", request.node_name));
    let csr = params.serialize_request(&key).map_err(|e| fail(&e))?.pem().map_err(|e| fail(&e))?;
    let object = CertificateSigningRequest {
        metadata: kube::api::ObjectMeta { generate_name: Some("csr-".into()), ..Default::default() },
        spec: CertificateSigningRequestSpec {
            request: ByteString(csr.into_bytes()),
            signer_name: request.signer.to_owned(),
            usages: Some(request.usages.iter().map(|u| (*u).to_owned()).collect()),
            ..CertificateSigningRequestSpec::default()
        },
        status: None,
    };
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let created = api.create(&PostParams::default(), &object).await.map_err(|e| fail(&e))?;
    let name = created.metadata.name.clone().unwrap_or_default();
    tracing::info!(csr = %name, signer = request.signer, "certificate signing request sent; waiting for approval and signing");
    let config = kube::runtime::watcher::Config::default().fields(&format!("metadata.name={name}"));
    // Quiet: the request stands while the watch resumes.
    let mut events =
        crate::mirror::watch_events(api, config, "certificate signing request", crate::mirror::Noise::Quiet);
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            event = events.next() => event,
        };
        let object = match event {
            None => return Err(CertificateError::Request(format!("the watch of {name} ended"))),
            Some(kube::runtime::watcher::Event::Apply(object) | kube::runtime::watcher::Event::InitApply(object)) => {
                object
            }
            Some(_) => continue,
        };
        let status = object.status.unwrap_or_default();
        for condition in status.conditions.iter().flatten() {
            if matches!(condition.type_.as_str(), "Denied" | "Failed") && condition.status == "True" {
                return Err(CertificateError::Refused {
                    name,
                    outcome: condition.type_.to_lowercase(),
                    message: condition.message.clone().or(condition.reason.clone()).unwrap_or_default(),
                });
            }
        }
        if let Some(certificate) = status.certificate.filter(|c| !c.0.is_empty()) {
            let cert_pem = String::from_utf8_lossy(&certificate.0).into_owned();
            let issued = IssuedCertificate::from_pem(cert_pem, key.serialize_pem(), jiff::Timestamp::now())?;
            tracing::info!(csr = %name, not_after = %issued.not_after, "certificate issued");
            return Ok(Some(issued));
        }
    }
}

/// Writes `issued` as `<dir>/<prefix>-<time>.pem` (certificate and key)
/// and points `<dir>/<prefix>-current.pem` at it; returns the link's path.
pub fn store(dir: &Path, prefix: &str, issued: &IssuedCertificate) -> Result<PathBuf, CertificateError> {
    let file_error = |path: &Path, source| crate::pki::tls::TlsError::File { path: path.to_owned(), source };
    std::fs::create_dir_all(dir).map_err(|e| file_error(dir, e))?;
    let stamp = jiff::Timestamp::now().strftime("%Y-%m-%d-%H-%M-%S-%f").to_string();
    let file = dir.join(format!("{prefix}-{stamp}.pem"));
    write_private(&file, format!("{}{}", issued.cert_pem, issued.key_pem).as_bytes())?;
    let current = dir.join(format!("{prefix}-current.pem"));
    let link = dir.join(format!(".{prefix}-current.pem.tmp"));
    let _ = std::fs::remove_file(&link);
    // Relative to the link's own directory, whatever the cert dir's path.
    let target = format!("{prefix}-{stamp}.pem");
    std::os::unix::fs::symlink(&target, &link).map_err(|e| file_error(&link, e))?;
    std::fs::rename(&link, &current).map_err(|e| file_error(&current, e))?;
    crate::durable::sync_parent(&current).map_err(|e| file_error(dir, e))?;
    Ok(current)
}

/// Reads `<dir>/<prefix>-current.pem` if it holds a certificate valid now.
pub fn load_current(dir: &Path, prefix: &str) -> Option<IssuedCertificate> {
    let path = dir.join(format!("{prefix}-current.pem"));
    let text = std::fs::read_to_string(&path).ok()?;
    let received = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| jiff::Timestamp::try_from(t).ok())
        .unwrap_or_else(jiff::Timestamp::now);
    let key_start = text
        .match_indices("-----BEGIN ")
        .map(|(i, _)| i)
        .find(|&i| text[i..].lines().next().is_some_and(|line| line.contains("PRIVATE KEY")))?;
    let (cert_pem, key_pem) = text.split_at(key_start);
    let issued = IssuedCertificate::from_pem(cert_pem.to_owned(), key_pem.to_owned(), received).ok()?;
    (jiff::Timestamp::now() < issued.not_after).then_some(issued)
}

/// The kubeconfig at `path`, parsed.
fn read_kubeconfig(path: &Path) -> Result<kube::config::Kubeconfig, CertificateError> {
    kube::config::Kubeconfig::read_from(path)
        .map_err(|e| CertificateError::Kubeconfig { path: path.to_owned(), reason: kubelet_api::uds::error_chain(&e) })
}

/// Whether the kubeconfig at `path` can be used as it is: it exists and,
/// if it names a client certificate, that certificate is valid now.
async fn usable(path: &Path) -> bool {
    let Ok(kubeconfig) = read_kubeconfig(path) else { return false };
    let options = kube::config::KubeConfigOptions::default();
    let Ok(config) = kube::Config::from_custom_kubeconfig(kubeconfig, &options).await else { return false };
    let data = match (&config.auth_info.client_certificate_data, &config.auth_info.client_certificate) {
        (Some(data), _) => base64_decode(data),
        (None, Some(file)) => std::fs::read(file).ok(),
        (None, None) => return true,
    };
    let Some(pem) = data else { return false };
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let leaf = CertificateDer::pem_slice_iter(&pem).next().and_then(Result::ok);
    leaf.and_then(|leaf| certificate_facts(&leaf).ok()).is_some_and(|facts| jiff::Timestamp::now() < facts.not_after)
}

fn base64_decode(data: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(data.trim()).ok()
}

/// With rotation asked for and no valid certificate in the store, the
/// store starts from the client certificate and key embedded in
/// `--kubeconfig`, as upstream's does (kubeadm's `kubelet.conf` carries
/// them): `kubelet-client-current.pem` then exists, for kubeadm's
/// `kubelet-finalize` phase to point the kubeconfig at, after which the
/// node rotates it. `Ok(None)`: nothing to seed.
pub(crate) fn seed_from_kubeconfig(settings: &BootstrapSettings) -> Result<Option<PathBuf>, CertificateError> {
    if !settings.rotate || load_current(&settings.cert_dir, "kubelet-client").is_some() {
        return Ok(None);
    }
    let bad = |reason: String| CertificateError::Kubeconfig { path: settings.kubeconfig.clone(), reason };
    let text = std::fs::read_to_string(&settings.kubeconfig).map_err(|e| bad(e.to_string()))?;
    let document: serde_json::Value = serde_saphyr::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let context_name = document["current-context"].as_str().unwrap_or_default();
    let contexts = document["contexts"].as_array().cloned().unwrap_or_default();
    let user_name = contexts
        .iter()
        .find(|c| c["name"] == context_name)
        .and_then(|c| c["context"]["user"].as_str().map(str::to_owned))
        .unwrap_or_default();
    let users = document["users"].as_array().cloned().unwrap_or_default();
    let Some(user) = users.iter().find(|u| u["name"] == user_name.as_str()).map(|u| &u["user"]) else {
        return Ok(None);
    };
    let embedded = |field: &str| user[field].as_str().and_then(base64_decode).and_then(|b| String::from_utf8(b).ok());
    let (Some(cert_pem), Some(key_pem)) = (embedded("client-certificate-data"), embedded("client-key-data")) else {
        return Ok(None);
    };
    let issued = IssuedCertificate::from_pem(cert_pem, key_pem, jiff::Timestamp::now())?;
    if jiff::Timestamp::now() >= issued.not_after {
        return Ok(None);
    }
    store(&settings.cert_dir, "kubelet-client", &issued).map(Some)
}

/// Writes a kubeconfig for the cluster of `bootstrap` using the client
/// certificate and key in `pem`.
fn write_kubeconfig(path: &Path, bootstrap: &Path, pem: &Path) -> Result<(), CertificateError> {
    let source = read_kubeconfig(bootstrap)?;
    let context_name = source.current_context.clone().unwrap_or_default();
    let context =
        source.contexts.iter().find(|c| c.name == context_name).and_then(|c| c.context.clone()).ok_or_else(|| {
            CertificateError::Kubeconfig { path: bootstrap.to_owned(), reason: "no current context".into() }
        })?;
    let mut cluster =
        source.clusters.iter().find(|c| c.name == context.cluster).and_then(|c| c.cluster.clone()).ok_or_else(
            || CertificateError::Kubeconfig {
                path: bootstrap.to_owned(),
                reason: format!("no cluster {:?}", context.cluster),
            },
        )?;
    // A relative CA path in the bootstrap kubeconfig is relative to it.
    if let Some(ca) = cluster.certificate_authority.as_mut() {
        let ca_path = Path::new(ca.as_str());
        if ca_path.is_relative() {
            *ca = bootstrap.parent().unwrap_or(Path::new(".")).join(ca_path).display().to_string();
        }
    }
    let pem = pem.display().to_string();
    let document = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "default-cluster", "cluster": cluster}],
        "contexts": [{"name": "default-context", "context": {"cluster": "default-cluster", "user": "default-auth", "namespace": "default"}}],
        "current-context": "default-context",
        "users": [{"name": "default-auth", "user": {"client-certificate": pem, "client-key": pem}}],
    });
    let text = serde_json::to_string_pretty(&document)
        .map_err(|e| CertificateError::Kubeconfig { path: path.to_owned(), reason: e.to_string() })?;
    if let Some(parent) = path.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    write_private(path, text.as_bytes())?;
    Ok(())
}

/// What a client certificate is asked for with.
fn client_request(node_name: &str) -> Request<'_> {
    Request {
        signer: CLIENT_SIGNER,
        node_name,
        dns_names: Vec::new(),
        ips: Vec::new(),
        usages: &["digital signature", "client auth"],
    }
}

/// Makes sure `settings.kubeconfig` works: bootstraps a client certificate
/// with the bootstrap kubeconfig when it has none valid. `Ok(false)`:
/// stopped by `shutdown`.
pub(crate) async fn bootstrap(
    settings: &BootstrapSettings,
    node_name: &str,
    shutdown: &CancellationToken,
) -> Result<bool, CertificateError> {
    if usable(&settings.kubeconfig).await {
        match seed_from_kubeconfig(settings) {
            Ok(Some(current)) => tracing::info!(
                kubeconfig = %settings.kubeconfig.display(),
                cert = %current.display(),
                "the certificate store starts from the kubeconfig's embedded client certificate"
            ),
            Ok(None) => {}
            Err(error) => tracing::warn!(%error, "cannot seed the certificate store from the kubeconfig"),
        }
        return Ok(true);
    }
    let Some(bootstrap) = &settings.bootstrap_kubeconfig else {
        return Err(CertificateError::Kubeconfig {
            path: settings.kubeconfig.clone(),
            reason: "missing, or its client certificate expired, and no bootstrap kubeconfig is given".into(),
        });
    };
    // A certificate from an earlier bootstrap that did not get as far as
    // the kubeconfig is used.
    let current = match load_current(&settings.cert_dir, "kubelet-client") {
        Some(_) => settings.cert_dir.join("kubelet-client-current.pem"),
        None => {
            tracing::info!(bootstrap = %bootstrap.display(), "no valid client certificate: TLS bootstrap");
            let client = super::from_kubeconfig(bootstrap)
                .await
                .map_err(|e| CertificateError::Kubeconfig { path: bootstrap.clone(), reason: e.to_string() })?;
            let Some(issued) = request_certificate(&client, &client_request(node_name), shutdown).await? else {
                return Ok(false);
            };
            store(&settings.cert_dir, "kubelet-client", &issued)?
        }
    };
    let current = std::path::absolute(&current).unwrap_or(current);
    write_kubeconfig(&settings.kubeconfig, bootstrap, &current)?;
    tracing::info!(kubeconfig = %settings.kubeconfig.display(), cert = %current.display(), "TLS bootstrap done");
    Ok(true)
}

type Https = hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>;
type Http = hyper_util::client::legacy::Client<hyper_timeout::TimeoutConnector<Https>, kube::client::Body>;

/// An HTTP client on `https` with the kubeconfig's connect, read and write
/// timeouts, as kube's own client has them.
fn http_client(config: &kube::Config, https: Https) -> Http {
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    hyper_util::client::legacy::Builder::new(hyper_util::rt::TokioExecutor::new()).build(connector)
}

/// Sends each request with the HTTP client of the current identity. A
/// rotation puts a new client (new connections, new certificate) in place
/// for the requests that follow; requests under way (watches included)
/// finish on the old one's connections, which close once nothing uses
/// them: nothing is cut off by the switch.
#[derive(Clone)]
struct RotatingHttp {
    current: Arc<RwLock<Http>>,
}

impl tower::Service<http::Request<kube::client::Body>> for RotatingHttp {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper_util::client::legacy::Error;
    type Future = hyper_util::client::legacy::ResponseFuture;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<kube::client::Body>) -> Self::Future {
        let client = self.current.read().unwrap_or_else(|p| p.into_inner()).clone();
        client.request(request)
    }
}

async fn connector_of(path: &Path) -> Result<(kube::Config, Https), CertificateError> {
    let kubeconfig = read_kubeconfig(path)?;
    let options = kube::config::KubeConfigOptions::default();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options).await.map_err(|e| {
        CertificateError::Kubeconfig { path: path.to_owned(), reason: kubelet_api::uds::error_chain(&e) }
    })?;
    let https = config.rustls_https_connector().map_err(|e| CertificateError::Kubeconfig {
        path: path.to_owned(),
        reason: kubelet_api::uds::error_chain(&e),
    })?;
    Ok((config, https))
}

/// Clients from `settings.kubeconfig` whose connections follow the
/// current client certificate, and (with `settings.rotate`) the task that
/// renews it: one client per `(qps, burst)` of `limits`, each with its own
/// connections and its own bucket, all following the same certificate
/// (renewed once, through the first).
pub(crate) async fn rotating_clients(
    settings: &BootstrapSettings,
    node_name: &str,
    metrics: &super::api_metrics::ApiMetrics,
    limits: &[(f64, u32)],
    supervision: &crate::Supervision,
) -> Result<Vec<kube::Client>, CertificateError> {
    use tower::ServiceBuilder;
    let (config, https) = connector_of(&settings.kubeconfig).await?;
    let bad = |e: kube::Error| CertificateError::Kubeconfig {
        path: settings.kubeconfig.clone(),
        reason: kubelet_api::uds::error_chain(&e),
    };
    let mut currents = Vec::new();
    let mut clients = Vec::new();
    for &(qps, burst) in limits {
        let current = Arc::new(RwLock::new(http_client(&config, https.clone())));
        let http = RotatingHttp { current: Arc::clone(&current) };
        let service = ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .option_layer(config.auth_layer().map_err(bad)?)
            .layer(config.extra_headers_layer().map_err(bad)?)
            .map_err(|e: hyper_util::client::legacy::Error| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
            .service(http);
        clients.push(
            kube::client::ClientBuilder::new(service, config.default_namespace.clone())
                .with_layer(&super::rate_limit::RateLimitLayer::new(qps, burst))
                .with_layer(&metrics.layer(super::api_metrics::url_host(&config.cluster_url)))
                .build(),
        );
        currents.push(current);
    }
    let Some(first) = clients.first().cloned() else { return Ok(clients) };
    let link = settings.cert_dir.join("kubelet-client-current.pem");
    let link = std::path::absolute(&link).unwrap_or(link);
    let follows_cert_dir =
        std::fs::read_to_string(&settings.kubeconfig).is_ok_and(|text| text.contains(&link.display().to_string()));
    if settings.rotate && !follows_cert_dir {
        tracing::warn!(kubeconfig = %settings.kubeconfig.display(), cert_dir = %settings.cert_dir.display(), "--rotate-certificates: the kubeconfig does not use <cert-dir>/kubelet-client-current.pem (it was not written by TLS bootstrap), so its certificate is not rotated");
    }
    if settings.rotate && follows_cert_dir {
        if let Some(current) = load_current(&settings.cert_dir, "kubelet-client") {
            metrics.client_certificate(current.not_after);
        }
        let renewal = ClientRenewal {
            settings: settings.clone(),
            node_name: node_name.to_owned(),
            client: first,
            current_http: currents,
            metrics: metrics.clone(),
        };
        let shutdown = supervision.shutdown().clone();
        // Restarted after a panic: each round reads the certificate in use
        // from the cert dir again.
        supervision.spawn("client-certificate-rotation", move || keep_renewed(renewal.clone(), shutdown.clone()));
    }
    Ok(clients)
}

/// One certificate kept renewed: what [`keep_renewed`] asks of it.
#[async_trait::async_trait]
pub trait Renewal: Send {
    /// What the logs call it (`client`, `serving`).
    fn name(&self) -> &'static str;
    /// The certificate in use now, if there is one.
    fn current(&mut self) -> Option<IssuedCertificate>;
    /// Gets a new certificate and puts it in use; `Ok(false)` when there is
    /// nothing more to do (shutdown, or no way to get one, said in the log):
    /// the loop then waits for shutdown, so that a supervisor does not run
    /// it again.
    async fn renew(
        &mut self,
        current: Option<&IssuedCertificate>,
        shutdown: &CancellationToken,
    ) -> Result<bool, CertificateError>;
    /// Counts a failed renewal.
    fn failed(&self);
}

/// The one rotation loop of both the client and the serving certificate:
/// wait until the one in use is at 70–90% of its lifetime (at once when
/// there is none), renew it, and after a failure try again with the one
/// backoff (1 s doubling to 1 min, jittered), the one in use staying in use
/// while it is valid.
pub async fn keep_renewed(mut renewal: impl Renewal, shutdown: CancellationToken) {
    let mut backoff = crate::retry::RetryBackoff::new(Duration::from_secs(1), Duration::from_secs(60));
    let name = renewal.name();
    loop {
        let current = renewal.current();
        if let Some(issued) = &current {
            let at = issued.renew_at();
            let now = jiff::Timestamp::now();
            let wait = if at > now { now.duration_until(at).unsigned_abs() } else { Duration::ZERO };
            tracing::info!(certificate = name, not_after = %issued.not_after, renew_at = %at, "certificate renewal scheduled");
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
        match renewal.renew(current.as_ref(), &shutdown).await {
            Ok(false) => {
                shutdown.cancelled().await;
                return;
            }
            Ok(true) => {
                backoff.reset();
                tracing::info!(certificate = name, "certificate renewed; new connections use it");
            }
            Err(error) => {
                renewal.failed();
                let delay = backoff.next_delay();
                tracing::error!(certificate = name, %error, retry_in = ?delay, "certificate renewal failed; the one in use stays in use while it is valid");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// The client certificate's renewal: through the node's client while the
/// current certificate is valid, else (expired, or gone) through the
/// bootstrap identity; the rotating connections take the new one.
#[derive(Clone)]
struct ClientRenewal {
    settings: BootstrapSettings,
    node_name: String,
    client: kube::Client,
    current_http: Vec<Arc<RwLock<Http>>>,
    metrics: super::api_metrics::ApiMetrics,
}

#[async_trait::async_trait]
impl Renewal for ClientRenewal {
    fn name(&self) -> &'static str {
        "client"
    }

    fn current(&mut self) -> Option<IssuedCertificate> {
        load_current(&self.settings.cert_dir, "kubelet-client")
    }

    async fn renew(
        &mut self,
        current: Option<&IssuedCertificate>,
        shutdown: &CancellationToken,
    ) -> Result<bool, CertificateError> {
        let renewer = match current {
            Some(_) => self.client.clone(),
            None => {
                let Some(bootstrap) = &self.settings.bootstrap_kubeconfig else {
                    tracing::error!(dir = %self.settings.cert_dir.display(), "the client certificate expired (or is gone) and no bootstrap kubeconfig is given: the node cannot reach the API until it gets a new kubeconfig");
                    return Ok(false);
                };
                tracing::warn!("the client certificate expired: TLS bootstrap again with the bootstrap kubeconfig");
                super::from_kubeconfig(bootstrap).await.map_err(|error| CertificateError::Kubeconfig {
                    path: bootstrap.clone(),
                    reason: format!("the bootstrap kubeconfig cannot be used: {error}"),
                })?
            }
        };
        let Some(new) = request_certificate_within(&renewer, &client_request(&self.node_name), shutdown).await? else {
            return Ok(false);
        };
        if new.not_after <= jiff::Timestamp::now() {
            return Err(CertificateError::Request("the issued certificate has already expired".into()));
        }
        store(&self.settings.cert_dir, "kubelet-client", &new)?;
        self.metrics.client_certificate(new.not_after);
        let (config, https) = connector_of(&self.settings.kubeconfig).await?;
        for current in &self.current_http {
            *current.write().unwrap_or_else(|p| p.into_inner()) = http_client(&config, https.clone());
        }
        Ok(true)
    }

    fn failed(&self) {
        self.metrics.client_renewal_failed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issued(lifetime_secs: i64) -> IssuedCertificate {
        let issued: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().expect("time");
        IssuedCertificate {
            cert_pem: String::new(),
            key_pem: String::new(),
            issued,
            not_after: issued + jiff::SignedDuration::from_secs(lifetime_secs),
        }
    }

    #[test]
    fn a_certificates_debug_shows_no_key() {
        let mut certificate = issued(1000);
        certificate.key_pem = "-----BEGIN PRIVATE KEY-----\nsecret\n-----END PRIVATE KEY-----\n".into();
        let shown = format!("{certificate:?}");
        assert!(!shown.contains("secret") && !shown.contains("PRIVATE KEY"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn renewal_falls_between_70_and_90_percent_of_the_lifetime() {
        let certificate = issued(1000);
        for _ in 0..200 {
            let after = certificate.renew_at().duration_since(certificate.issued).as_secs_f64();
            assert!((700.0..=900.0).contains(&after), "{after}");
        }
    }

    /// kubeadm's `kubelet.conf` embeds the node's certificate and key:
    /// with rotation asked for, the store starts from them, once.
    #[test]
    fn the_store_is_seeded_from_an_embedded_certificate() {
        use base64::Engine as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(rcgen::DnType::CommonName, "system:node:cp1");
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + time::Duration::days(365);
        let cert = params.self_signed(&key).expect("cert");
        let b64 = |text: &str| base64::engine::general_purpose::STANDARD.encode(text);
        let kubeconfig = dir.path().join("kubelet.conf");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: kubernetes\n  cluster: {{server: 'https://192.0.2.1:6443'}}\n\
             contexts:\n- name: system:node:cp1@kubernetes\n  context: {{cluster: kubernetes, user: system:node:cp1}}\n\
             current-context: system:node:cp1@kubernetes\nusers:\n- name: system:node:cp1\n  user:\n    \
             client-certificate-data: {}\n    client-key-data: {}\n",
            b64(&cert.pem()),
            b64(&key.serialize_pem())
        );
        std::fs::write(&kubeconfig, text).expect("write");
        let cert_dir = dir.path().join("pki");
        let settings =
            BootstrapSettings { kubeconfig, bootstrap_kubeconfig: None, cert_dir: cert_dir.clone(), rotate: true };
        let current = seed_from_kubeconfig(&settings).expect("seeded").expect("a file");
        assert_eq!(current, cert_dir.join("kubelet-client-current.pem"));
        let stored = load_current(&cert_dir, "kubelet-client").expect("loaded");
        assert_eq!(stored.cert_pem.trim(), cert.pem().trim());
        assert_eq!(seed_from_kubeconfig(&settings).expect("again"), None, "seeded once");
        let settings = BootstrapSettings { rotate: false, cert_dir: dir.path().join("other"), ..settings };
        assert_eq!(seed_from_kubeconfig(&settings).expect("no rotation"), None, "only with rotation");
    }

    #[test]
    fn a_stored_certificate_is_loaded_back_while_valid() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(rcgen::DnType::CommonName, "system:node:n1");
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + time::Duration::hours(1);
        let cert = params.self_signed(&key).expect("cert");
        let issued =
            IssuedCertificate::from_pem(cert.pem(), key.serialize_pem(), jiff::Timestamp::now()).expect("facts");
        assert!(
            issued.issued > jiff::Timestamp::now() - jiff::SignedDuration::from_secs(60),
            "backdating is not counted"
        );
        let link = store(dir.path(), "kubelet-client", &issued).expect("store");
        assert!(std::fs::symlink_metadata(&link).expect("link").file_type().is_symlink());
        let loaded = load_current(dir.path(), "kubelet-client").expect("loaded");
        assert_eq!(loaded.not_after, issued.not_after);
        assert!(loaded.key_pem.contains("PRIVATE KEY"));
        assert!(loaded.cert_pem.contains("BEGIN CERTIFICATE") && !loaded.cert_pem.contains("PRIVATE"));
    }
}
