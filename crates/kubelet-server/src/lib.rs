//! The kubelet API: HTTPS on `--address`:`--port` (10250), what the API
//! server proxies `kubectl logs`, `exec`, `attach`, `port-forward` and
//! `kubectl top` (metrics-server) to, advertised in the Node's
//! `status.daemonEndpoints.kubeletEndpoint.port`.
//!
//! - TLS with rustls: the serving certificate from files, or self-signed
//!   under the cert dir as the kubelet makes one ([`tls`]).
//! - Authentication: a client certificate verified against the client CA
//!   (its common name is the user, its organizations the groups), else a
//!   bearer token by TokenReview, else anonymous if allowed; otherwise 401.
//!   Authorization: a SubjectAccessReview on `nodes/<node>` with the
//!   kubelet's verb and subresource mapping, cached; or always allowed
//!   ([`auth`]).
//! - Endpoints: `/pods`, `/runningpods/`, `/containerLogs/...` (every
//!   `PodLogOptions` field), `/exec/...`, `/attach/...` and
//!   `/portForward/...` (proxied to the runtime's streaming server, as the
//!   kubelet does), `/stats/summary`, `/metrics/resource`, `/metrics`,
//!   `/metrics/cadvisor`, `/metrics/probes`, `/healthz`, `/configz`,
//!   `/logs/` (the node's log dir and the log query, [`SystemLogSettings`]);
//!   every request counted in the kubelet's `kubelet_http_*` series.
//!
//! Each connection is served by its own task: a TLS handshake has 10 s, a
//! request's head 30 s; a client cannot hold the listener.

pub mod auth;
mod cadvisor;
mod http_metrics;
pub(crate) mod log_limit;
mod log_watcher;
pub(crate) mod logs;
mod node_logs;
pub mod plain;
mod spdy;
mod spdy_dictionary;
mod state;
mod stats;
mod streaming;
mod websocket;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;
use tracing::Instrument as _;

pub use auth::{AuthSettings, AuthorizationMode, User};
pub use node_logs::SystemLogSettings;

use crate::provider::Provider;
use kubelet_cluster::pki::tls;
use kubelet_cluster::{self as cluster, pki};
use kubelet_plugins::{csi, device_manager, plugin_manager};
use kubelet_pods::{pod, static_pods};
use kubelet_provider as provider;
#[cfg(test)]
use kubelet_support::fuzz;
use kubelet_support::health;
use kubelet_support::supervisor::Supervision;
use state::HttpState;

/// Where the serving certificate comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServingCertSource {
    /// `--tls-cert-file` and `--tls-private-key-file`.
    Files {
        /// The certificate chain (PEM).
        cert: PathBuf,
        /// Its private key (PEM).
        key: PathBuf,
    },
    /// Self-signed, made under the cert dir (`kubelet.crt`, `kubelet.key`)
    /// and reused while it is valid.
    SelfSigned,
    /// Requested from the cluster (`--rotate-server-certificates`): a CSR
    /// for signer `kubernetes.io/kubelet-serving` naming the node's host
    /// names and IPs, kept in `<cert-dir>/kubelet-server-current.pem` and
    /// renewed at 70–90% of its lifetime. Until one is issued (someone must
    /// approve it), TLS handshakes fail.
    Requested,
}

/// The kubelet API's settings.
#[derive(Clone, Debug)]
pub struct KubeletApiConfig {
    /// Where it listens (`--address`, `--port`; port 0 picks a free one).
    pub address: SocketAddr,
    /// The serving certificate.
    pub serving: ServingCertSource,
    /// Where the node keeps certificates it makes (`--cert-dir`).
    pub cert_dir: PathBuf,
    /// CA bundle client certificates are verified against
    /// (`--client-ca-file`); none: client certificates are not accepted.
    pub client_ca: Option<PathBuf>,
    /// Authentication and authorization.
    pub auth: AuthSettings,
    /// The host names the serving certificate names besides the node's.
    pub host_names: Vec<String>,
    /// Where a requested serving certificate's lifetime and failed
    /// renewals are counted (`kubelet_certificate_manager_server_ttl_seconds`).
    pub metrics: crate::cluster::api_metrics::ApiMetrics,
    /// `/logs/`: the node's log dir and the log query.
    pub system_logs: SystemLogSettings,
}

impl KubeletApiConfig {
    /// The kubelet's defaults: `0.0.0.0:10250`, self-signed under
    /// `<root_dir>/pki`, no client CA, upstream's authentication and
    /// authorization defaults (see [`AuthSettings`]).
    pub fn new(root_dir: &std::path::Path) -> Self {
        KubeletApiConfig {
            address: SocketAddr::from(([0, 0, 0, 0], kubelet_api::constants::KUBELET_PORT)),
            serving: ServingCertSource::SelfSigned,
            cert_dir: root_dir.join("pki"),
            client_ca: None,
            auth: AuthSettings::default(),
            host_names: Vec::new(),
            metrics: crate::cluster::api_metrics::ApiMetrics::default(),
            system_logs: SystemLogSettings::default(),
        }
    }
}

/// Why the kubelet API could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeletApiError {
    /// TLS could not be set up.
    #[error("kubelet API TLS: {0}")]
    Tls(#[from] tls::TlsError),
    /// The address could not be bound.
    #[error("cannot listen on {address} for the kubelet API: {source}")]
    Bind {
        /// The address asked for.
        address: SocketAddr,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The settings cannot work together.
    #[error("kubelet API: {0}")]
    Settings(String),
}

/// What the handlers read.
#[derive(Clone)]
pub(crate) struct ApiState {
    pub(crate) http: HttpState,
    pub(crate) provider: Option<Arc<dyn Provider>>,
    rates: Arc<stats::Rates>,
    configz: Arc<serde_json::Value>,
    system_logs: Arc<SystemLogSettings>,
}

/// A bound, not yet serving, kubelet API.
pub struct BoundApi {
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    auth: auth::Auth,
    serving: tls::ServingCertificate,
    renewal: Option<ServingRenewal>,
    system_logs: SystemLogSettings,
    /// Where it listens.
    pub address: SocketAddr,
}

/// Connections served at once at most; more wait to be accepted.
const MAX_CONNECTIONS: usize = 4096;
/// A TLS handshake's deadline.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// A request head's deadline.
const HEADER_DEADLINE: Duration = Duration::from_secs(30);

/// Sets up TLS and binds the address. `client` is the API client once
/// cluster mode is connected (webhooks wait for it); `ips` the node's IPs
/// for a self-signed certificate.
pub async fn bind(
    config: &KubeletApiConfig,
    node_name: &str,
    ips: &[std::net::IpAddr],
    client: watch::Receiver<Option<kube::Client>>,
    standalone: bool,
) -> Result<BoundApi, KubeletApiError> {
    if standalone && (config.auth.authorization == AuthorizationMode::Webhook) {
        return Err(KubeletApiError::Settings(
            "--authorization-mode=Webhook needs an API server; use AlwaysAllow on a standalone node".into(),
        ));
    }
    let mut names = vec![node_name.to_owned()];
    names.extend(config.host_names.iter().filter(|n| *n != node_name).cloned());
    let mut renewal = None;
    let key = match &config.serving {
        ServingCertSource::Files { cert, key } => Some(tls::load_pair(cert, key)?),
        ServingCertSource::SelfSigned => Some(tls::self_signed(&config.cert_dir, &names, ips)?),
        ServingCertSource::Requested => {
            if standalone {
                return Err(KubeletApiError::Settings(
                    "--rotate-server-certificates needs an API server to sign the certificate".into(),
                ));
            }
            let current = crate::cluster::certificates::load_current(&config.cert_dir, "kubelet-server");
            let key = current.as_ref().map(|c| tls::certified_from_pem(&c.cert_pem, &c.key_pem)).transpose()?;
            renewal = Some(ServingRenewal {
                cert_dir: config.cert_dir.clone(),
                node_name: node_name.to_owned(),
                names: names.clone(),
                ips: ips.to_vec(),
                current,
                client: client.clone(),
                metrics: config.metrics.clone(),
            });
            key
        }
    };
    let serving = tls::ServingCertificate::new(key);
    let tls = tls::server_config(serving.clone(), config.client_ca.as_deref())?;
    let listener = TcpListener::bind(config.address)
        .await
        .map_err(|source| KubeletApiError::Bind { address: config.address, source })?;
    let address = listener.local_addr().map_err(|source| KubeletApiError::Bind { address: config.address, source })?;
    let auth = auth::Auth::new(config.auth.clone(), node_name, client);
    Ok(BoundApi { listener, tls, auth, address, serving, renewal, system_logs: config.system_logs.clone() })
}

impl BoundApi {
    /// Serves until `supervision`'s shutdown: `http` is what the handlers
    /// read, `provider` runs exec, attach and port-forward, `configz` is
    /// what `/configz` shows. The serving certificate's renewal, when it
    /// has one, is watched by `supervision`; the returned task (the
    /// listener, bound once) is for the caller to watch.
    pub fn serve(
        self,
        http: HttpState,
        provider: Option<Arc<dyn Provider>>,
        configz: serde_json::Value,
        supervision: &Supervision,
    ) -> JoinHandle<()> {
        let shutdown = supervision.shutdown().clone();
        let state = ApiState {
            http,
            provider,
            rates: Arc::default(),
            configz: Arc::new(configz),
            system_logs: Arc::new(self.system_logs.clone()),
        };
        if let Some(renewal) = self.renewal {
            let renewing = tokio::spawn(renewal.run(self.serving.clone(), shutdown.clone()));
            supervision.watch("serving-certificate-renewal", renewing);
        }
        let failures = state.http.tls_failures.clone();
        let router = router(state, self.auth.clone());
        let acceptor = tokio_rustls::TlsAcceptor::from(self.tls);
        let address = self.address;
        let listener = self.listener;
        tracing::info!(%address, "kubelet API listening (HTTPS)");
        let span = tracing::info_span!("kubelet_api", %address);
        // Not supervised here: the listener, returned to the node, which watches it (`kubelet-api`).
        tokio::spawn(
            async move {
                let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
                loop {
                    let Ok(slot) = Arc::clone(&slots).acquire_owned().await else { return };
                    let accepted = tokio::select! {
                        () = shutdown.cancelled() => return,
                        accepted = listener.accept() => accepted,
                    };
                    let (stream, peer) = match accepted {
                        Ok(accepted) => accepted,
                        Err(error) => {
                            // Out of descriptors, say: the next accept may work.
                            tracing::warn!(%error, "kubelet API accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let (acceptor, router, shutdown) = (acceptor.clone(), router.clone(), shutdown.clone());
                    let failures = failures.clone();
                    // Not supervised: one connection.
                    tokio::spawn(
                        async move {
                            let _slot = slot;
                            connection(stream, peer, acceptor, router, failures, shutdown).await;
                        }
                        .instrument(tracing::debug_span!("connection", %peer)),
                    );
                }
            }
            .instrument(span),
        )
    }
}

/// What the serving certificate is requested with, and the one in use.
struct ServingRenewal {
    cert_dir: PathBuf,
    node_name: String,
    names: Vec<String>,
    ips: Vec<std::net::IpAddr>,
    current: Option<crate::cluster::certificates::IssuedCertificate>,
    client: watch::Receiver<Option<kube::Client>>,
    metrics: crate::cluster::api_metrics::ApiMetrics,
}

impl ServingRenewal {
    /// Requests the serving certificate when there is none, and again at
    /// 70–90% of each one's lifetime (the one rotation loop,
    /// `certificates::keep_renewed`, once the node has an API client); the
    /// new one serves from the next handshake on.
    async fn run(self, serving: tls::ServingCertificate, shutdown: CancellationToken) {
        let mut client = self.client.clone();
        let client = tokio::select! {
            () = shutdown.cancelled() => return,
            client = client.wait_for(Option::is_some) => client.ok().and_then(|c| c.clone()),
        };
        let Some(client) = client else { return };
        let renewing = ServingRenewing { renewal: self, client, serving };
        crate::cluster::certificates::keep_renewed(renewing, shutdown).await;
    }
}

/// The serving certificate's renewal, with the node's API client and the
/// certificate the listener serves.
struct ServingRenewing {
    renewal: ServingRenewal,
    client: kube::Client,
    serving: tls::ServingCertificate,
}

#[async_trait::async_trait]
impl crate::cluster::certificates::Renewal for ServingRenewing {
    fn name(&self) -> &'static str {
        "serving"
    }

    fn current(&mut self) -> Option<crate::cluster::certificates::IssuedCertificate> {
        let current = self.renewal.current.clone();
        if let Some(current) = &current {
            self.renewal.metrics.server_certificate(current.not_after);
        }
        current
    }

    async fn renew(
        &mut self,
        _current: Option<&crate::cluster::certificates::IssuedCertificate>,
        shutdown: &CancellationToken,
    ) -> Result<bool, crate::cluster::certificates::CertificateError> {
        use crate::cluster::certificates::{
            CertificateError, Request, SERVING_SIGNER, request_certificate_within, store,
        };
        let renewal = &self.renewal;
        let request = Request {
            signer: SERVING_SIGNER,
            node_name: &renewal.node_name,
            dns_names: renewal.names.clone(),
            ips: renewal.ips.clone(),
            usages: &["digital signature", "server auth"],
        };
        let Some(issued) = request_certificate_within(&self.client, &request, shutdown).await? else {
            return Ok(false);
        };
        store(&renewal.cert_dir, "kubelet-server", &issued)?;
        let key = tls::certified_from_pem(&issued.cert_pem, &issued.key_pem)
            .map_err(|e| CertificateError::Request(format!("the issued serving certificate cannot be used: {e}")))?;
        self.serving.replace(key);
        tracing::info!(not_after = %issued.not_after, "serving certificate in use");
        self.renewal.current = Some(issued);
        Ok(true)
    }

    fn failed(&self) {
        self.renewal.metrics.server_renewal_failed();
    }
}

/// Handshake failures by reason: `kubelet_api_tls_handshake_failures_total`.
pub(crate) type TlsFailures = prometheus_client::metrics::family::Family<
    Vec<(&'static str, &'static str)>,
    prometheus_client::metrics::counter::Counter,
>;

/// Why a TLS handshake failed, as the metric's `reason` label says it.
/// A client that closes the connection before the handshake (a port
/// probe) is `closed`; the rest are certificates refused or protocol
/// errors.
pub(crate) fn handshake_failure_reason(error: &std::io::Error) -> &'static str {
    use rustls::{CertificateError, Error};
    if error.kind() == std::io::ErrorKind::UnexpectedEof
        || error.kind() == std::io::ErrorKind::ConnectionReset
        || error.kind() == std::io::ErrorKind::BrokenPipe
    {
        return "closed";
    }
    let Some(tls) = error.get_ref().and_then(|inner| inner.downcast_ref::<Error>()) else { return "io" };
    match tls {
        Error::InvalidCertificate(certificate) => match certificate {
            CertificateError::UnknownIssuer | CertificateError::BadSignature => "unknown_authority",
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => "expired",
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => "not_yet_valid",
            CertificateError::Revoked => "revoked",
            CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => "wrong_usage",
            // webpki refuses X.509 v1 certificates and malformed ones here.
            _ => "bad_certificate",
        },
        Error::NoCertificatesPresented => "no_certificate",
        // The resolver has no certificate to serve (a requested one not
        // issued yet): rustls says so in this general error.
        Error::General(text) if text.contains("no server certificate") => "no_serving_certificate",
        _ => "protocol",
    }
}

static HANDSHAKE_WARNINGS: log_limit::LogLimiter = log_limit::LogLimiter::new();

/// Counts a failed handshake and logs it (rate-limited; port probes that
/// close at once only at debug).
fn handshake_failed(failures: &TlsFailures, peer: SocketAddr, reason: &'static str, error: &dyn std::fmt::Display) {
    failures.get_or_create(&vec![("reason", reason)]).inc();
    if reason == "closed" {
        tracing::debug!(%peer, %error, "TLS handshake ended by the client");
    } else if let Some(left_out) = HANDSHAKE_WARNINGS.admit() {
        tracing::warn!(%peer, reason, %error, left_out, "kubelet API: TLS handshake failed");
    }
}

/// Serves one connection: handshake, identity, HTTP/1.1 with upgrades.
async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    router: axum::Router,
    failures: TlsFailures,
    shutdown: CancellationToken,
) {
    let tls = match tokio::time::timeout(HANDSHAKE_DEADLINE, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(error)) => {
            handshake_failed(&failures, peer, handshake_failure_reason(&error), &error);
            return;
        }
        Err(_) => {
            handshake_failed(&failures, peer, "timeout", &format_args!("no handshake within {HANDSHAKE_DEADLINE:?}"));
            return;
        }
    };
    let peer = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .and_then(|leaf| User::from_certificate(leaf));
    let identity = auth::PeerIdentity(peer);
    let service = hyper::service::service_fn(move |mut request: http::Request<hyper::body::Incoming>| {
        request.extensions_mut().insert(identity.clone());
        router.clone().oneshot(request.map(axum::body::Body::new))
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(HEADER_DEADLINE);
    let connection = builder.serve_connection(TokioIo::new(tls), service).with_upgrades();
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%error, "connection ended with an error");
            }
        }
        () = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
    }
}

fn router(state: ApiState, auth: auth::Auth) -> axum::Router {
    let metrics = state.http.http_metrics.clone();
    let http_routes = axum::Router::new()
        .route("/healthz", get(plain::healthz))
        .route("/healthz/{check}", get(plain::healthz_check))
        .route("/metrics", get(plain::metrics))
        .route("/metrics/probes", get(plain::probes))
        .route("/pods", get(plain::pods))
        .route("/containerLogs/{namespace}/{pod}/{container}", get(logs::container_logs))
        .with_state(state.http.clone());
    axum::Router::new()
        .route("/runningpods/", get(streaming::running_pods))
        .route("/configz", get(configz))
        .route("/logs", get(system_logs))
        .route("/logs/", get(system_logs))
        .route("/logs/{*path}", get(system_logs))
        .route("/stats/summary", get(stats::summary))
        .route("/metrics/resource", get(stats::resource_metrics))
        .route("/metrics/cadvisor", get(cadvisor::metrics))
        .route("/exec/{namespace}/{pod}/{container}", any(streaming::exec))
        .route("/exec/{namespace}/{pod}/{uid}/{container}", any(streaming::exec_uid))
        .route("/attach/{namespace}/{pod}/{container}", any(streaming::attach))
        .route("/attach/{namespace}/{pod}/{uid}/{container}", any(streaming::attach_uid))
        .route("/portForward/{namespace}/{pod}", any(streaming::port_forward))
        .route("/portForward/{namespace}/{pod}/{uid}", any(streaming::port_forward_uid))
        .with_state(state)
        .merge(http_routes)
        .layer(axum::middleware::from_fn_with_state(auth, auth::check))
        .layer(axum::middleware::from_fn_with_state(metrics, http_metrics::record))
}

async fn system_logs(State(state): State<ApiState>, uri: http::Uri, headers: http::HeaderMap) -> Response {
    node_logs::serve(&state.system_logs, &uri, &headers).await
}

async fn configz(State(state): State<ApiState>) -> Response {
    Json(serde_json::json!({ "kubeletconfig": *state.configz })).into_response()
}
