//! Liveness, readiness and startup probes, with upstream's semantics.
//!
//! Each probe of a running container instance has a worker task. It waits
//! `initialDelaySeconds` from the container's start (and, for liveness and
//! readiness, until a startup probe has passed), then probes every
//! `periodSeconds`, each attempt bounded by `timeoutSeconds`. A result
//! counts once it repeats `successThreshold` (success) or
//! `failureThreshold` (failure) times in a row; only a change of the
//! counted result is reported to the pod's lifecycle. A failed liveness or
//! startup probe kills the container (within the probe's
//! `terminationGracePeriodSeconds`, else the pod's) and the worker ends: the
//! restart policy decides what comes next, as for any exit.
//!
//! Probes go only to the pod itself: its own IP when its provider gave it a
//! network of its own, else loopback (host-network pods, WebAssembly pods);
//! a host-network pod's own addresses are every node IP too (kubeadm's API
//! server probes the advertise address). A `host` naming anything else is
//! refused with a clear message.
//!
//! A probe that cannot run at all (a named port the container does not
//! declare, a provider that cannot exec) is an error, not a failure: the
//! result is thrown away, as upstream does, and the reason logged.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::data::{ContainerEvent, ProbeReport};
use crate::provider::{ContainerId, Provider};

/// The user agent of probe requests, as upstream's (its version is the
/// Kubernetes version the node speaks).
pub const USER_AGENT: &str = "kube-probe/1.28";

/// How much of a command's output a failure message keeps.
const MAX_OUTPUT: usize = 10 * 1024;

/// Which probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ProbeKind {
    /// Restarts the container when it fails.
    Liveness,
    /// Drives the container's `ready`.
    Readiness,
    /// Holds the other two until it passes; restarts the container when it
    /// fails.
    Startup,
}

impl ProbeKind {
    /// `Liveness`, `Readiness`, `Startup`, as upstream's messages name them.
    pub(crate) fn title(self) -> &'static str {
        match self {
            ProbeKind::Liveness => "Liveness",
            ProbeKind::Readiness => "Readiness",
            ProbeKind::Startup => "Startup",
        }
    }

    /// Whether a failure kills the container.
    pub(crate) fn kills(self) -> bool {
        self != ProbeKind::Readiness
    }
}

/// What a probe does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Runs a command in the container; exit code 0 is success.
    Exec(Vec<String>),
    /// GETs a path; a status from 200 to 399 is success.
    Http {
        /// HTTPS (certificates are not checked, as upstream).
        https: bool,
        /// `host`, when set.
        host: Option<String>,
        /// The port.
        port: u16,
        /// The path (and query).
        path: String,
        /// Extra headers.
        headers: Vec<(String, String)>,
    },
    /// Opens a TCP connection.
    Tcp {
        /// `host`, when set.
        host: Option<String>,
        /// The port.
        port: u16,
    },
    /// Calls `grpc.health.v1.Health/Check`; `SERVING` is success.
    Grpc {
        /// The port.
        port: u16,
        /// The service asked about (empty: the server).
        service: String,
    },
}

/// One probe of a container, with upstream's defaults filled in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ProbeSpec {
    /// Which probe.
    pub kind: ProbeKind,
    /// What it does, or why it cannot run.
    pub action: Result<Action, String>,
    /// `initialDelaySeconds`.
    pub initial_delay: Duration,
    /// `periodSeconds` (default 10, at least 1).
    pub period: Duration,
    /// `timeoutSeconds` (default 1, at least 1).
    pub timeout: Duration,
    /// `successThreshold` (default 1; always 1 for liveness and startup).
    pub success_threshold: u32,
    /// `failureThreshold` (default 3).
    pub failure_threshold: u32,
    /// `terminationGracePeriodSeconds` of the probe, when set.
    pub termination_grace: Option<Duration>,
}

fn seconds(value: Option<i32>, default: u64, min: u64) -> Duration {
    Duration::from_secs(value.map_or(default, |v| u64::try_from(v).unwrap_or(0)).max(min))
}

fn count(value: Option<i32>, default: u32) -> u32 {
    value.map_or(default, |v| u32::try_from(v).unwrap_or(1)).max(1)
}

impl ProbeSpec {
    /// The container's probe of `kind`, if it has one.
    pub(crate) fn of(kind: ProbeKind, container: &Container) -> Option<ProbeSpec> {
        let probe = match kind {
            ProbeKind::Liveness => container.liveness_probe.as_ref(),
            ProbeKind::Readiness => container.readiness_probe.as_ref(),
            ProbeKind::Startup => container.startup_probe.as_ref(),
        }?;
        Some(ProbeSpec {
            kind,
            action: action(probe, container),
            initial_delay: seconds(probe.initial_delay_seconds, 0, 0),
            period: seconds(probe.period_seconds, 10, 1),
            timeout: seconds(probe.timeout_seconds, 1, 1),
            success_threshold: if kind.kills() { 1 } else { count(probe.success_threshold, 1) },
            failure_threshold: count(probe.failure_threshold, 3),
            termination_grace: probe
                .termination_grace_period_seconds
                .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0))),
        })
    }
}

/// A port as a probe names it: a number, or the name of one of the
/// container's ports.
pub(crate) fn port(port: &IntOrString, container: &Container) -> Result<u16, String> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).ok().filter(|n| *n > 0).ok_or_else(|| format!("invalid port {n}")),
        IntOrString::String(name) => {
            if let Ok(n) = name.parse::<u16>() {
                return Ok(n);
            }
            let ports = container.ports.iter().flatten();
            let found = ports.clone().find(|p| p.name.as_deref() == Some(name.as_str()));
            found
                .and_then(|p| u16::try_from(p.container_port).ok())
                .ok_or_else(|| format!("couldn't find port {name:?} among container {:?}'s ports", container.name))
        }
    }
}

fn action(probe: &Probe, container: &Container) -> Result<Action, String> {
    if let Some(exec) = &probe.exec {
        let command = exec.command.clone().unwrap_or_default();
        if command.is_empty() {
            return Err("exec probe has no command".into());
        }
        return Ok(Action::Exec(command));
    }
    if let Some(http) = &probe.http_get {
        let path = http.path.clone().unwrap_or_default();
        let path = if path.starts_with('/') { path } else { format!("/{path}") };
        return Ok(Action::Http {
            https: http.scheme.as_deref().is_some_and(|s| s.eq_ignore_ascii_case("HTTPS")),
            host: http.host.clone().filter(|h| !h.is_empty()),
            port: port(&http.port, container)?,
            path,
            headers: http.http_headers.iter().flatten().map(|h| (h.name.clone(), h.value.clone())).collect(),
        });
    }
    if let Some(tcp) = &probe.tcp_socket {
        return Ok(Action::Tcp { host: tcp.host.clone().filter(|h| !h.is_empty()), port: port(&tcp.port, container)? });
    }
    if let Some(grpc) = &probe.grpc {
        let port =
            u16::try_from(grpc.port).ok().filter(|p| *p > 0).ok_or_else(|| format!("invalid port {}", grpc.port))?;
        return Ok(Action::Grpc { port, service: grpc.service.clone().unwrap_or_default() });
    }
    Err("the probe names no handler (exec, httpGet, tcpSocket or grpc)".into())
}

/// The result of one attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Healthy.
    Success,
    /// Healthy, with a warning the pod's events show (`ProbeWarning`): an
    /// HTTP probe redirected to another host, not followed.
    Warning(String),
    /// Unhealthy, and why.
    Failure(String),
    /// The probe could not run; the result does not count.
    Error(String),
}

/// What a probe talks to.
#[derive(Clone)]
pub(crate) struct Target {
    /// Runs exec probes.
    pub provider: Arc<dyn Provider>,
    /// The container instance.
    pub id: ContainerId,
    /// The pod's address: its own IP, else loopback.
    pub address: IpAddr,
    /// Other addresses that are the pod's own (a host-network pod's: the
    /// node's IPs).
    pub also: Vec<IpAddr>,
}

impl Target {
    /// The address for a probe naming `host`: the pod's own only.
    fn address_for(&self, host: Option<&str>) -> Result<IpAddr, String> {
        own_address(self.address, &self.also, host)
    }
}

/// The address a probe naming `host` goes to, if it is the pod's own:
/// `address`, or one of `also` (a host-network pod's node IPs).
fn own_address(address: IpAddr, also: &[IpAddr], host: Option<&str>) -> Result<IpAddr, String> {
    let Some(host) = host else { return Ok(address) };
    let named = if host.eq_ignore_ascii_case("localhost") && address.is_loopback() {
        Ok(address)
    } else {
        host.trim_matches(['[', ']']).parse::<IpAddr>().map_err(|_| host.to_owned())
    };
    match named {
        Ok(ip) if ip == address || also.contains(&ip) => Ok(ip),
        _ => Err(format!("probe host {host:?} is not this pod's address {address}: probes go only to the pod itself")),
    }
}

/// Runs one attempt of `action` against `target`, bounded by `timeout`.
pub(crate) async fn probe_once(action: &Action, target: &Target, timeout: Duration) -> Outcome {
    match action {
        Action::Exec(command) => exec(command, target, timeout).await,
        Action::Http { https, host, port, path, headers } => {
            let ip = match target.address_for(host.as_deref()) {
                Ok(ip) => ip,
                Err(message) => return Outcome::Error(message),
            };
            let host_header = match host {
                Some(h) => format!("{h}:{port}"),
                None => SocketAddr::new(ip, *port).to_string(),
            };
            let request = HttpRequest { https: *https, addr: SocketAddr::new(ip, *port), host_header, headers };
            match tokio::time::timeout(timeout, http(&request, path)).await {
                Ok(outcome) => outcome,
                Err(_) => Outcome::Failure(format!(
                    "Get \"{}://{}{path}\": context deadline exceeded (Client.Timeout exceeded while awaiting headers)",
                    if *https { "https" } else { "http" },
                    request.host_header
                )),
            }
        }
        Action::Tcp { host, port } => {
            let ip = match target.address_for(host.as_deref()) {
                Ok(ip) => ip,
                Err(message) => return Outcome::Error(message),
            };
            let addr = SocketAddr::new(ip, *port);
            match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await {
                Ok(Ok(_)) => Outcome::Success,
                Ok(Err(e)) => Outcome::Failure(format!("dial tcp {addr}: connect: {e}")),
                Err(_) => Outcome::Failure(format!("dial tcp {addr}: i/o timeout")),
            }
        }
        Action::Grpc { port, service } => grpc(SocketAddr::new(target.address, *port), service, timeout).await,
    }
}

fn cut(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX_OUTPUT)]);
    text.trim_end().to_owned()
}

async fn exec(command: &[String], target: &Target, timeout: Duration) -> Outcome {
    // The provider bounds the command by `timeout`; the node bounds the
    // provider by a little more, so that a stuck runtime cannot stall it.
    let call = target.provider.exec_sync(&target.id, command, timeout);
    match tokio::time::timeout(timeout + Duration::from_secs(1), call).await {
        Err(_) => Outcome::Failure(format!("command {:?} timed out", command.join(" "))),
        Ok(Err(e)) if e.kind == crate::provider::ProviderErrorKind::Timeout => {
            Outcome::Failure(format!("command {:?} timed out", command.join(" ")))
        }
        Ok(Err(e)) => Outcome::Error(format!("exec probe: {e}")),
        Ok(Ok(out)) if out.exit_code == 0 => Outcome::Success,
        Ok(Ok(out)) => {
            let mut output = out.stdout;
            output.extend_from_slice(&out.stderr);
            let text = cut(&output);
            Outcome::Failure(if text.is_empty() {
                format!("command {:?} exited with {}", command.join(" "), out.exit_code)
            } else {
                text
            })
        }
    }
}

struct HttpRequest<'a> {
    https: bool,
    addr: SocketAddr,
    host_header: String,
    headers: &'a [(String, String)],
}

/// One GET of `path` at `addr` (a lifecycle hook's): the status, or why
/// there was none. Certificates are not checked for HTTPS, as upstream.
pub(crate) async fn get_status(
    https: bool,
    addr: SocketAddr,
    host_header: String,
    headers: &[(String, String)],
    path: &str,
) -> Result<u16, String> {
    let request = HttpRequest { https, addr, host_header, headers };
    get(&request, path).await.map(|response| response.status().as_u16())
}

/// GETs `path`, following up to 10 redirects within the same host.
async fn http(request: &HttpRequest<'_>, path: &str) -> Outcome {
    let mut path = path.to_owned();
    for _ in 0..=10 {
        let response = match get(request, &path).await {
            Ok(response) => response,
            Err(message) => return Outcome::Failure(message),
        };
        let status = response.status();
        if status.is_redirection() {
            let location = response.headers().get(http::header::LOCATION).and_then(|l| l.to_str().ok());
            match location.map(|l| same_host_path(l, &request.host_header)) {
                Some(Some(next)) => {
                    path = next;
                    continue;
                }
                // A redirect elsewhere is not followed: upstream counts it
                // a success, with a warning carrying the body.
                _ => {
                    let body = body_text(response, MAX_BODY).await;
                    return Outcome::Warning(format!("Probe terminated redirects, Response body: {body}"));
                }
            }
        }
        return if (200..400).contains(&status.as_u16()) {
            Outcome::Success
        } else {
            Outcome::Failure(format!("HTTP probe failed with statuscode: {}", status.as_u16()))
        };
    }
    Outcome::Failure("stopped after 10 redirects".into())
}

/// How much of a response body a probe reads (upstream's 10 KiB).
const MAX_BODY: usize = 10 << 10;

/// The first `limit` bytes of `response`'s body, as text.
async fn body_text(response: http::Response<hyper::body::Incoming>, limit: usize) -> String {
    use hyper::body::Body as _;
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    while bytes.len() < limit {
        match std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    bytes.extend_from_slice(&data);
                }
            }
            _ => break,
        }
    }
    bytes.truncate(limit);
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The path of `location` when it stays on `host` (a relative location, or
/// an absolute one naming the same host).
fn same_host_path(location: &str, host: &str) -> Option<String> {
    if location.starts_with('/') {
        return Some(location.to_owned());
    }
    let rest = location.strip_prefix("http://").or_else(|| location.strip_prefix("https://"))?;
    let (authority, path) = rest.split_once('/').map_or((rest, "/".to_owned()), |(a, p)| (a, format!("/{p}")));
    (authority == host).then_some(path)
}

async fn get(request: &HttpRequest<'_>, path: &str) -> Result<http::Response<hyper::body::Incoming>, String> {
    let scheme = if request.https { "https" } else { "http" };
    let url = format!("{scheme}://{}{path}", request.host_header);
    let stream = tokio::net::TcpStream::connect(request.addr)
        .await
        .map_err(|e| format!("Get \"{url}\": dial tcp {}: connect: {e}", request.addr))?;
    let mut builder = http::Request::get(path);
    let has = |name: &str| request.headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(name));
    for (name, value) in request.headers {
        builder = builder.header(name.as_str(), value.as_str());
    }
    if !has("host") {
        builder = builder.header(http::header::HOST, request.host_header.as_str());
    }
    if !has("user-agent") {
        builder = builder.header(http::header::USER_AGENT, USER_AGENT);
    }
    if !has("accept") {
        builder = builder.header(http::header::ACCEPT, "*/*");
    }
    builder = builder.header(http::header::CONNECTION, "close");
    let req = builder.body(String::new()).map_err(|e| format!("Get \"{url}\": {e}"))?;
    let response = if request.https {
        let name = rustls::pki_types::ServerName::IpAddress(request.addr.ip().into());
        let stream = tls_connector()?.connect(name, stream).await.map_err(|e| format!("Get \"{url}\": tls: {e}"))?;
        send(stream, req).await
    } else {
        send(stream, req).await
    };
    response.map_err(|e| format!("Get \"{url}\": {e}"))
}

/// One HTTP/1.1 request on `stream` (closed after it).
async fn send<S>(
    stream: S,
    request: http::Request<String>,
) -> Result<http::Response<hyper::body::Incoming>, hyper::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    // Not supervised: one probe's HTTP connection.
    tokio::spawn(conn);
    sender.send_request(request).await
}

/// TLS that does not check the server's certificate: upstream's HTTPS
/// probes skip verification too (a pod's serving certificate rarely names
/// its IP). Built once.
fn tls_connector() -> Result<tokio_rustls::TlsConnector, String> {
    static CONNECTOR: std::sync::OnceLock<Result<tokio_rustls::TlsConnector, String>> = std::sync::OnceLock::new();
    CONNECTOR
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let schemes = provider.signature_verification_algorithms.supported_schemes();
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("TLS for HTTPS probes: {e}"))?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(schemes)))
                .with_no_client_auth();
            Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
        })
        .clone()
}

#[derive(Debug)]
struct AnyCertificate(Vec<rustls::SignatureScheme>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.clone()
    }
}

async fn grpc(addr: SocketAddr, service: &str, timeout: Duration) -> Outcome {
    use kubelet_api::health::v1::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let endpoint = match tonic::transport::Endpoint::from_shared(format!("http://{addr}")) {
        Ok(endpoint) => endpoint.connect_timeout(timeout).timeout(timeout),
        Err(e) => return Outcome::Error(format!("grpc probe: {e}")),
    };
    let endpoint = match endpoint.user_agent(USER_AGENT) {
        Ok(endpoint) => endpoint,
        Err(e) => return Outcome::Error(format!("grpc probe: {e}")),
    };
    let channel = match tokio::time::timeout(timeout, endpoint.connect()).await {
        Ok(Ok(channel)) => channel,
        Ok(Err(e)) => {
            return Outcome::Failure(format!(
                "timeout: failed to connect service {addr:?} within {}s: {e}",
                timeout.as_secs()
            ));
        }
        Err(_) => {
            return Outcome::Failure(format!(
                "timeout: failed to connect service {addr:?} within {}s",
                timeout.as_secs()
            ));
        }
    };
    let mut client = HealthClient::new(channel);
    let call = client.check(HealthCheckRequest { service: service.to_owned() });
    match tokio::time::timeout(timeout, call).await {
        Err(_) => Outcome::Failure(format!("timeout: health rpc did not complete within {}s", timeout.as_secs())),
        Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => Outcome::Failure(format!(
            "this server does not implement the grpc health protocol (grpc.health.v1.Health): {}",
            status.message()
        )),
        Ok(Err(status)) if status.code() == tonic::Code::DeadlineExceeded => {
            Outcome::Failure(format!("timeout: health rpc did not complete within {}s", timeout.as_secs()))
        }
        Ok(Err(status)) => {
            Outcome::Failure(format!("rpc error: code = {:?} desc = {}", status.code(), status.message()))
        }
        Ok(Ok(response)) => {
            let status = response.into_inner().status();
            if status == ServingStatus::Serving {
                Outcome::Success
            } else {
                Outcome::Failure(format!("service unhealthy (responded with {:?})", status.as_str_name()))
            }
        }
    }
}

/// Counts attempts the way upstream does: a result counts once it has
/// repeated its threshold times in a row.
#[derive(Debug)]
pub(crate) struct Counter {
    success_threshold: u32,
    failure_threshold: u32,
    /// The last attempt's result and how many times in a row it came.
    last: Option<(bool, u32)>,
    /// The counted result.
    counted: Option<bool>,
}

impl Counter {
    /// A counter with `spec`'s thresholds; `initial` is the counted result
    /// before any attempt (readiness starts unready, the others unknown).
    pub(crate) fn new(spec: &ProbeSpec, initial: Option<bool>) -> Counter {
        Counter {
            success_threshold: spec.success_threshold,
            failure_threshold: spec.failure_threshold,
            last: None,
            counted: initial,
        }
    }

    /// Takes one attempt's result; returns the counted result when it
    /// changes.
    pub(crate) fn observe(&mut self, healthy: bool) -> Option<bool> {
        let run = match self.last {
            Some((last, n)) if last == healthy => n.saturating_add(1),
            _ => 1,
        };
        self.last = Some((healthy, run));
        let threshold = if healthy { self.success_threshold } else { self.failure_threshold };
        if run < threshold || self.counted == Some(healthy) {
            return None;
        }
        self.counted = Some(healthy);
        Some(healthy)
    }
}

/// What a probe worker needs.
pub(crate) struct Worker {
    /// The probe.
    pub spec: ProbeSpec,
    /// What it probes.
    pub target: Target,
    /// The container's name.
    pub container: String,
    /// When the container instance started.
    pub started_at: Instant,
    /// The startup probe's verdict (`true` once it passed, or when the
    /// container has none); the startup worker sends it.
    pub started: watch::Receiver<bool>,
    /// Where the startup worker says the container started.
    pub start_sender: Option<watch::Sender<bool>>,
    /// The pod's grace period (a killing probe's own wins).
    pub pod_grace: Duration,
    /// Where results go.
    pub events: mpsc::UnboundedSender<ContainerEvent>,
    /// The pod, for its `Unhealthy` events.
    pub pod: Arc<k8s_openapi::api::core::v1::Pod>,
    /// Where those go (one per failed attempt, as upstream records them).
    pub recorder: crate::events::EventRecorder,
    /// Where each attempt is counted (`prober_probe_total`).
    pub metrics: crate::metrics::ProbeMetrics,
}

impl Worker {
    /// Probes until the container instance ends (the task is aborted then),
    /// or until a killing probe killed it, or a startup probe passed.
    pub(crate) async fn run(mut self) {
        let spec = &self.spec;
        tokio::time::sleep_until(self.started_at + spec.initial_delay).await;
        if spec.kind != ProbeKind::Startup && self.started.wait_for(|s| *s).await.is_err() {
            return;
        }
        let mut counter = Counter::new(spec, (spec.kind == ProbeKind::Readiness).then_some(false));
        let mut ticks = tokio::time::interval(spec.period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_error: Option<String> = None;
        let identity = crate::metrics::ProbeIdentity {
            probe_type: spec.kind.title(),
            container: self.container.clone(),
            pod: self.pod.metadata.name.clone().unwrap_or_default(),
            namespace: self.pod.metadata.namespace.clone().unwrap_or_default(),
            pod_uid: self.pod.metadata.uid.clone().unwrap_or_default(),
        };
        // The series go with the worker, as upstream deletes them.
        let _forget = Forget(&self.metrics, &identity);
        loop {
            ticks.tick().await;
            let began = Instant::now();
            let outcome = match &spec.action {
                Ok(action) => probe_once(action, &self.target, spec.timeout).await,
                Err(message) => Outcome::Error(message.clone()),
            };
            let healthy = match &outcome {
                Outcome::Success | Outcome::Warning(_) => Some(true),
                Outcome::Failure(_) => Some(false),
                Outcome::Error(_) => None,
            };
            self.metrics.observe(&identity, healthy, began.elapsed());
            let (healthy, message) = match outcome {
                Outcome::Success => (true, String::new()),
                Outcome::Warning(message) => {
                    let event = format!("{} probe warning: {message}", spec.kind.title());
                    let warning = crate::events::EventType::Warning;
                    self.recorder.pod(&self.pod, Some(&self.container), warning, "ProbeWarning", event);
                    (true, String::new())
                }
                Outcome::Failure(message) => {
                    let event = format!("{} probe failed: {message}", spec.kind.title());
                    let warning = crate::events::EventType::Warning;
                    self.recorder.pod(&self.pod, Some(&self.container), warning, "Unhealthy", event);
                    (false, message)
                }
                Outcome::Error(message) => {
                    if last_error.as_deref() != Some(&message) {
                        tracing::warn!(container = %self.container, probe = spec.kind.title(), error = %message, "probe errored; its result is not counted");
                        last_error = Some(message);
                    }
                    continue;
                }
            };
            last_error = None;
            let Some(counted) = counter.observe(healthy) else { continue };
            let report = ProbeReport {
                container: self.container.clone(),
                id: self.target.id.clone(),
                kind: spec.kind,
                healthy: counted,
                message: message.clone(),
            };
            if self.events.send(ContainerEvent::Probe(report)).is_err() {
                return;
            }
            if counted && spec.kind == ProbeKind::Startup {
                if let Some(sender) = self.start_sender.take() {
                    let _ = sender.send(true);
                }
                return;
            }
            if !counted && spec.kind.kills() {
                self.kill().await;
                return;
            }
        }
    }
}

/// Forgets a probe's series when dropped.
struct Forget<'a>(&'a crate::metrics::ProbeMetrics, &'a crate::metrics::ProbeIdentity);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.0.forget(self.1);
    }
}

impl Worker {
    /// Kills the container after a failed liveness or startup probe,
    /// trying again (with backoff) until the runtime takes it; the task is
    /// aborted once the exit is recorded.
    async fn kill(&self) {
        let mut grace = self.spec.termination_grace.unwrap_or(self.pod_grace);
        // As upstream, the preStop hook runs first, within the grace period.
        let spec = self.pod.spec.iter().flat_map(|s| s.containers.iter()).find(|c| c.name == self.container);
        if let Some(spec) = spec.filter(|c| super::hooks::Hook::PreStop.handler(c).is_some() && !grace.is_zero()) {
            let began = Instant::now();
            let hook = super::hooks::Hook::PreStop;
            let t = &self.target;
            if let Err(message) = super::hooks::run(hook, &t.provider, &self.pod, spec, &t.id, t.address, grace).await {
                tracing::warn!(container = %self.container, %message, "preStop hook failed");
                let reason = hook.failure_reason();
                self.recorder.pod(&self.pod, Some(&self.container), crate::events::EventType::Warning, reason, message);
            }
            grace = grace.saturating_sub(began.elapsed()).max(super::hooks::MIN_STOP_GRACE);
        }
        let mut backoff = crate::retry::RetryBackoff::new(Duration::from_millis(500), Duration::from_secs(30));
        loop {
            tracing::info!(container = %self.container, id = %self.target.id, probe = self.spec.kind.title(), ?grace, "killing the container: its probe failed");
            match self.target.provider.stop_container(&self.target.id, grace).await {
                Ok(()) => return,
                Err(error) => {
                    let retry = backoff.next_delay();
                    tracing::warn!(container = %self.container, %error, ?retry, "could not kill the container after its probe failed; trying again");
                    tokio::time::sleep(retry).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerPort, HTTPGetAction, TCPSocketAction};

    fn spec(success: u32, failure: u32) -> ProbeSpec {
        ProbeSpec {
            kind: ProbeKind::Readiness,
            action: Err(String::new()),
            initial_delay: Duration::ZERO,
            period: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            success_threshold: success,
            failure_threshold: failure,
            termination_grace: None,
        }
    }

    #[test]
    fn a_result_counts_once_it_repeats_its_threshold() {
        let mut counter = Counter::new(&spec(2, 3), Some(false));
        assert_eq!(counter.observe(true), None, "one success of two");
        assert_eq!(counter.observe(true), Some(true));
        assert_eq!(counter.observe(true), None, "no change");
        assert_eq!(counter.observe(false), None);
        assert_eq!(counter.observe(false), None);
        assert_eq!(counter.observe(true), None, "a success breaks the run of failures");
        assert_eq!(counter.observe(false), None);
        assert_eq!(counter.observe(false), None);
        assert_eq!(counter.observe(false), Some(false));
    }

    #[test]
    fn defaults_and_named_ports_follow_upstream() {
        let container = Container {
            name: "web".into(),
            ports: Some(vec![ContainerPort { name: Some("http".into()), container_port: 8080, ..Default::default() }]),
            liveness_probe: Some(Probe {
                http_get: Some(HTTPGetAction {
                    port: IntOrString::String("http".into()),
                    path: Some("healthz".into()),
                    ..Default::default()
                }),
                success_threshold: Some(5),
                ..Default::default()
            }),
            readiness_probe: Some(Probe {
                tcp_socket: Some(TCPSocketAction { port: IntOrString::String("metrics".into()), ..Default::default() }),
                period_seconds: Some(0),
                ..Default::default()
            }),
            ..Default::default()
        };
        let liveness = ProbeSpec::of(ProbeKind::Liveness, &container).expect("liveness");
        assert_eq!(
            liveness.action,
            Ok(Action::Http { https: false, host: None, port: 8080, path: "/healthz".into(), headers: vec![] })
        );
        assert_eq!(
            (liveness.period, liveness.timeout, liveness.success_threshold, liveness.failure_threshold),
            (Duration::from_secs(10), Duration::from_secs(1), 1, 3)
        );
        let readiness = ProbeSpec::of(ProbeKind::Readiness, &container).expect("readiness");
        assert_eq!(readiness.period, Duration::from_secs(1));
        assert!(readiness.action.expect_err("no such port").contains("\"metrics\""));
        assert_eq!(ProbeSpec::of(ProbeKind::Startup, &container), None);
    }

    #[test]
    fn a_host_network_pods_own_addresses_are_the_nodes() {
        let loopback = IpAddr::from([127, 0, 0, 1]);
        let node_ip = IpAddr::from([192, 0, 2, 10]);
        // kubeadm's API server probes its advertise address, the node's IP.
        assert_eq!(own_address(loopback, &[node_ip, loopback], Some("192.0.2.10")), Ok(node_ip));
        assert_eq!(own_address(loopback, &[], None), Ok(loopback));
        assert_eq!(own_address(loopback, &[], Some("localhost")), Ok(loopback));
        let refused = own_address(loopback, &[], Some("192.0.2.10")).expect_err("not the pod's");
        assert!(refused.contains("probes go only to the pod itself"), "{refused}");
        let elsewhere = own_address(IpAddr::from([10, 0, 0, 5]), &[], Some("10.0.0.6"));
        assert!(elsewhere.is_err());
    }

    #[test]
    fn redirects_are_followed_on_the_same_host_only() {
        assert_eq!(same_host_path("/next", "10.0.0.1:80").as_deref(), Some("/next"));
        assert_eq!(same_host_path("http://10.0.0.1:80/a?b", "10.0.0.1:80").as_deref(), Some("/a?b"));
        assert_eq!(same_host_path("http://example.com/a", "10.0.0.1:80"), None);
    }
}
