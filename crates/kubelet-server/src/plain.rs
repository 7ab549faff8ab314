//! The node's two plain-HTTP endpoints.
//!
//! - The health port (`--healthz-port`, TCP, no authentication) serves
//!   `/healthz` (and `/healthz/<check>`) and Prometheus `/metrics`, nothing
//!   else: any local user and any host-network pod can reach it.
//! - The local socket (`<root>/rustlet.sock`, mode 0600, and a connection
//!   is served only when its peer's credentials, read with `SO_PEERCRED`,
//!   are root's or the node's own user) serves all of the above and the
//!   node's own views: `/status` (JSON: plugins, CSI drivers, the node's
//!   CSI facts, the capacity of device-plugin resources and static manifest
//!   problems, in Kubernetes' camelCase), `/pods` (a `v1.PodList` of the
//!   node's pods with their statuses, as the kubelet's `/pods`), `/node`
//!   (the `v1.Node` this node would register) and
//!   `/containerLogs/<namespace>/<pod>/<container>` (the container's log
//!   text, as the kubelet serves it; see the `logs` module for its
//!   parameters).
//!
//! `/healthz` follows the kubelet's semantics: `200 ok` when every check
//! passes; otherwise `500` with one line per check (`[+]name ok` or
//! `[-]name failed: reason`) and `healthz check failed`. `?verbose` lists
//! the checks on success too. `/healthz/<check>` answers `200 ok` or `500`
//! with the check's reason, and `404` for a check that does not exist.
//! Every answer is read from snapshots: none waits on a busy component.

use std::fmt::Write as _;
use std::net::SocketAddr;

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::health::ComponentHealth;
use crate::state::text;
pub use crate::state::{HttpState, NodeViews};
use crate::static_pods::StaticPods;

/// The routes anyone who can reach the node's health port may use.
fn health_routes() -> axum::Router<HttpState> {
    axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/healthz/{check}", get(healthz_check))
        .route("/metrics", get(metrics))
}

/// Why a plain endpoint could not be served.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The HTTP endpoint could not listen.
    #[error("cannot bind the HTTP endpoint on {address}: {source}")]
    Http {
        /// The address asked for.
        address: SocketAddr,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The local socket (`<root>/rustlet.sock`) could not be bound.
    #[error("cannot serve the local socket {path}: {source}")]
    LocalSocket {
        /// The socket's path.
        path: std::path::PathBuf,
        /// What binding reported.
        #[source]
        source: kubelet_api::uds::UdsError,
    },
}

/// Binds `address` (the health port) and serves `/healthz` and `/metrics`
/// until `shutdown`. Returns the bound address (useful with port 0) and the
/// serving task.
pub async fn serve(
    address: SocketAddr,
    state: HttpState,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, JoinHandle<()>), EndpointError> {
    let listener =
        tokio::net::TcpListener::bind(address).await.map_err(|source| EndpointError::Http { address, source })?;
    let bound = listener.local_addr().map_err(|source| EndpointError::Http { address, source })?;
    let app = health_routes().with_state(state);
    tracing::info!(address = %bound, "http endpoint listening (/healthz, /metrics)");
    let span = tracing::info_span!("http_endpoint", address = %bound);
    // Not supervised here: returned to the node, which watches it (`http-endpoint`).
    let task = tokio::spawn(
        async move {
            let result = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
            if let Err(error) = result {
                tracing::error!(%error, "http endpoint failed");
            }
        }
        .instrument(span),
    );
    Ok((bound, task))
}

/// Binds the local socket at `path` (mode 0600) and serves every view of
/// the node on it until `shutdown`, to peers that are root or the node's
/// own user.
pub fn serve_local(
    path: &std::path::Path,
    state: HttpState,
    shutdown: CancellationToken,
) -> Result<JoinHandle<()>, EndpointError> {
    let listener = kubelet_api::uds::bind_with_mode(path, 0o600)
        .map_err(|source| EndpointError::LocalSocket { path: path.to_path_buf(), source })?;
    let refused = state.local_refused.clone();
    let app = health_routes()
        .route("/status", get(status))
        .route("/pods", get(pods))
        .route("/node", get(node))
        .route("/containerLogs/{namespace}/{pod}/{container}", get(super::logs::container_logs))
        .with_state(state);
    let listener = PeerChecked { inner: listener, own_uid: rustix::process::geteuid().as_raw(), refused };
    tracing::info!(socket = %path.display(), "local endpoint listening (/healthz, /metrics, /status, /pods, /node, /containerLogs)");
    let span = tracing::info_span!("local_endpoint", socket = %path.display());
    // Not supervised here: returned to the node, which watches it (`local-endpoint`).
    Ok(tokio::spawn(
        async move {
            let result = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
            if let Err(error) = result {
                tracing::error!(%error, "local endpoint failed");
            }
        }
        .instrument(span),
    ))
}

/// Whether a peer with user ID `uid` may use the local socket of a node
/// running as `own_uid`: root, and the node's own user.
pub(crate) fn local_peer_allowed(uid: u32, own_uid: u32) -> bool {
    uid == 0 || uid == own_uid
}

/// The local socket's listener: a connection whose peer is not allowed
/// ([`local_peer_allowed`]) is closed at once, logged (at most once a
/// minute, with the count since) and counted.
struct PeerChecked {
    inner: tokio::net::UnixListener,
    own_uid: u32,
    refused: prometheus_client::metrics::counter::Counter,
}

impl axum::serve::Listener for PeerChecked {
    type Io = tokio::net::UnixStream;
    type Addr = tokio::net::unix::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, address) = axum::serve::Listener::accept(&mut self.inner).await;
            let peer = stream.peer_cred();
            match peer {
                Ok(credentials) if local_peer_allowed(credentials.uid(), self.own_uid) => return (stream, address),
                Ok(credentials) => {
                    self.refused.inc();
                    if let Some(left_out) = LOCAL_REFUSALS.admit() {
                        tracing::warn!(
                            uid = credentials.uid(),
                            pid = ?credentials.pid(),
                            allowed = %format!("root and uid {}", self.own_uid),
                            left_out,
                            "local socket: refused a connection from a user that may not read the node"
                        );
                    }
                }
                Err(error) => {
                    self.refused.inc();
                    if let Some(left_out) = LOCAL_REFUSALS.admit() {
                        tracing::warn!(%error, left_out, "local socket: refused a connection whose peer cannot be read");
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

static LOCAL_REFUSALS: super::log_limit::LogLimiter = super::log_limit::LogLimiter::new();

pub(crate) async fn healthz(State(state): State<HttpState>, RawQuery(query): RawQuery) -> Response {
    let verbose = query.is_some_and(|q| q.split('&').any(|p| p == "verbose" || p.starts_with("verbose=")));
    let report = state.views.healthz.report();
    let healthy = report.iter().all(|r| r.health.is_healthy());
    if healthy && !verbose {
        return text(StatusCode::OK, "ok".into());
    }
    let mut body = String::new();
    for check in &report {
        let _ = match &check.health {
            ComponentHealth::Healthy => writeln!(body, "[+]{} ok", check.name),
            ComponentHealth::Failing { reason } => writeln!(body, "[-]{} failed: {reason}", check.name),
        };
    }
    if healthy {
        body.push_str("healthz check passed\n");
        text(StatusCode::OK, body)
    } else {
        body.push_str("healthz check failed\n");
        text(StatusCode::INTERNAL_SERVER_ERROR, body)
    }
}

pub(crate) async fn healthz_check(State(state): State<HttpState>, Path(check): Path<String>) -> Response {
    match state.views.healthz.get(&check) {
        Some(ComponentHealth::Healthy) => text(StatusCode::OK, "ok".into()),
        Some(ComponentHealth::Failing { reason }) => {
            text(StatusCode::INTERNAL_SERVER_ERROR, format!("internal server error: {check} failed: {reason}\n"))
        }
        None => text(StatusCode::NOT_FOUND, format!("no health check named {check:?}\n")),
    }
}

pub(crate) async fn metrics(State(state): State<HttpState>) -> Response {
    registry_page(&state.metrics)
}

/// `GET /metrics/probes`: the prober's series.
pub(crate) async fn probes(State(state): State<HttpState>) -> Response {
    registry_page(&state.probes)
}

/// A registry's series in the text format the kubelet serves.
pub(crate) fn registry_page(registry: &prometheus_client::registry::Registry) -> Response {
    match kubelet_support::metrics::encode_text(registry) {
        Ok(body) => (StatusCode::OK, [(header::CONTENT_TYPE, kubelet_support::metrics::TEXT_CONTENT_TYPE)], body)
            .into_response(),
        Err(error) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode metrics: {error}")),
    }
}

async fn status(State(state): State<HttpState>) -> Response {
    Json(serde_json::json!({
        "nodeName": state.views.node_name,
        "healthz": state.views.healthz.report(),
        "plugins": state.views.plugins.status(),
        "csiDrivers": state.views.csi_drivers.list(),
        "csiNode": state.views.node_info.snapshot(),
        "extendedResources": *state.views.devices.capacity().borrow(),
        "manifestErrors": state.views.static_pods.as_ref().map(StaticPods::errors).unwrap_or_default(),
    }))
    .into_response()
}

pub(crate) async fn pods(State(state): State<HttpState>) -> Response {
    Json(serde_json::json!({
        "apiVersion": "v1",
        "kind": "PodList",
        "metadata": {},
        "items": state.views.pods.store().list(),
    }))
    .into_response()
}

async fn node(State(state): State<HttpState>) -> Response {
    let devices = state.views.devices.capacity().borrow().clone();
    let mut object =
        serde_json::to_value(state.views.description.object(&devices, &state.views.healthz)).unwrap_or_default();
    if let Some(map) = object.as_object_mut() {
        map.insert("apiVersion".into(), "v1".into());
        map.insert("kind".into(), "Node".into());
    }
    Json(object).into_response()
}
