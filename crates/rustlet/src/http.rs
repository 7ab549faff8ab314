//! The node's HTTP endpoint: `/healthz`, Prometheus `/metrics`, and `/status`
//! (JSON: plugins, CSI drivers, the node's published CSI facts and the
//! capacity of device-plugin resources).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use kubelet::csi::{CsiDriverRegistry, InMemoryNodeInfo};
use kubelet::device_manager::DeviceManager;
use kubelet::plugin_manager::PluginManagerHandle;
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What the handlers read.
#[derive(Clone)]
pub(crate) struct HttpState {
    pub(crate) node_name: String,
    pub(crate) metrics: Arc<Registry>,
    pub(crate) plugins: PluginManagerHandle,
    pub(crate) csi_drivers: CsiDriverRegistry,
    pub(crate) node_info: InMemoryNodeInfo,
    pub(crate) devices: DeviceManager,
}

/// Binds `address` and serves until `shutdown`. Returns the bound address
/// (useful with port 0).
pub(crate) async fn serve(
    address: SocketAddr,
    state: HttpState,
    shutdown: CancellationToken,
) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot bind the HTTP endpoint on {address}"))?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/status", get(status))
        .with_state(state);
    tracing::info!(address = %bound, "http endpoint listening (/healthz, /metrics, /status)");
    let task = tokio::spawn(async move {
        let result = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
        if let Err(error) = result {
            tracing::error!(%error, "http endpoint failed");
        }
    });
    Ok((bound, task))
}

async fn metrics(State(state): State<HttpState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.metrics) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            body,
        ),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            format!("cannot encode metrics: {error}"),
        ),
    }
}

async fn status(State(state): State<HttpState>) -> impl IntoResponse {
    let Some(plugins) = state.plugins.status().await else {
        return (StatusCode::SERVICE_UNAVAILABLE, "plugin manager stopped").into_response();
    };
    Json(serde_json::json!({
        "nodeName": state.node_name,
        "plugins": plugins,
        "csiDrivers": state.csi_drivers.list(),
        "csiNode": state.node_info.snapshot(),
        "extendedResources": *state.devices.capacity().borrow(),
    }))
    .into_response()
}
