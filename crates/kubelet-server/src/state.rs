//! What the node's HTTP surfaces share: the node's views, its metrics,
//! the streaming sessions and the log watcher.

use std::sync::Arc;

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::csi::{CsiDriverRegistry, InMemoryNodeInfo};
use crate::device_manager::DeviceManager;
use crate::health::Healthz;
use crate::log_watcher::LogWatcher;
use crate::plugin_manager::PluginManagerHandle;
use crate::pod::Pods;
use crate::static_pods::StaticPods;

/// The node's components its HTTP surfaces read.
#[derive(Clone)]
pub struct NodeViews {
    /// The node's name.
    pub node_name: String,
    /// The plugin manager (`/status`).
    pub plugins: PluginManagerHandle,
    /// The CSI driver registry (`/status`).
    pub csi_drivers: CsiDriverRegistry,
    /// The node's CSI facts (`/status`).
    pub node_info: InMemoryNodeInfo,
    /// The device manager (`/status`, `/node`).
    pub devices: DeviceManager,
    /// The node's checks (`/healthz`, `/node`).
    pub healthz: Healthz,
    /// The pods (`/pods`, logs, streaming, stats).
    pub pods: Pods,
    /// The static pod source, if any (`/status`).
    pub static_pods: Option<StaticPods>,
    /// What describes the Node (`/node`).
    pub description: crate::cluster::capacity::NodeDescription,
    /// The node's root dir (pod logs).
    pub root_dir: std::path::PathBuf,
}

/// What the handlers read: the node's views, its metrics, and the
/// endpoints' own state (streaming sessions, the log watcher, counters).
#[derive(Clone)]
pub struct HttpState {
    /// The node's components.
    pub(crate) views: NodeViews,
    pub(crate) metrics: Arc<Registry>,
    /// Streaming sessions under way (log follows, exec, attach,
    /// port-forward): counted, bounded, ended at shutdown.
    pub(crate) sessions: Sessions,
    /// The one inotify watcher of every log follow.
    pub(crate) log_watcher: LogWatcher,
    /// Connections the local socket refused (`rustlet_local_socket_refused_total`).
    pub(crate) local_refused: prometheus_client::metrics::counter::Counter,
    /// Failed TLS handshakes of the kubelet API, by reason.
    pub(crate) tls_failures: super::TlsFailures,
    /// The kubelet API's request series.
    pub(crate) http_metrics: crate::http_metrics::HttpMetrics,
    /// `/metrics/probes`: the prober's series.
    pub(crate) probes: Arc<Registry>,
}

impl HttpState {
    /// The state of the node's HTTP surfaces: `views`, and `metrics` with
    /// the endpoints' own series registered into it; at most
    /// `max_sessions` streaming sessions at once, run on `tasks` and ended
    /// at `shutdown`.
    pub fn new(
        views: NodeViews,
        mut metrics: Registry,
        max_sessions: usize,
        shutdown: &CancellationToken,
        tasks: &tokio_util::task::TaskTracker,
    ) -> HttpState {
        let sessions = prometheus_client::metrics::gauge::Gauge::default();
        metrics.register(
            "kubelet_api_streaming_sessions",
            "Log follows, exec, attach and port-forward sessions under way",
            sessions.clone(),
        );
        let sessions_refused = prometheus_client::metrics::counter::Counter::default();
        metrics.register(
            "rustlet_streaming_sessions_refused_total",
            "Streaming sessions refused because the node served its limit (--max-streaming-sessions)",
            sessions_refused.clone(),
        );
        let sessions = Sessions::new(max_sessions, sessions, sessions_refused, shutdown.clone(), tasks.clone());
        let local_refused = prometheus_client::metrics::counter::Counter::default();
        metrics.register(
            "rustlet_local_socket_refused_total",
            "Connections to the local socket refused for their peer's user",
            local_refused.clone(),
        );
        let tls_failures = super::TlsFailures::default();
        metrics.register(
            "kubelet_api_tls_handshake_failures_total",
            "TLS handshakes of the kubelet API that failed, by reason (unknown_authority, expired, bad_certificate, \
             no_serving_certificate, protocol, timeout, closed, ...)",
            tls_failures.clone(),
        );
        let http_metrics = crate::http_metrics::HttpMetrics::default();
        http_metrics.register(&mut metrics);
        kubelet_support::metrics::register_process_metrics(&mut metrics);
        let node_name = views.node_name.clone();
        metrics.register_collector(kubelet_support::metrics::ScrapeFamily::gauge(
            "kubelet_node_name",
            "[ALPHA] The node's name. The count is always 1.",
            &["node"],
            move || vec![(vec![node_name.clone()], 1.0)],
        ));
        let mut probes = Registry::default();
        views.pods.metrics().probes().register(&mut probes);
        kubelet_support::metrics::register_process_start_time(&mut probes);
        HttpState {
            views,
            metrics: Arc::new(metrics),
            http_metrics,
            probes: Arc::new(probes),
            sessions,
            log_watcher: LogWatcher::new(shutdown.clone()),
            local_refused,
            tls_failures,
        }
    }
}

/// The streaming sessions (log follows, exec, attach, port-forward): at
/// most `limit` at once (more are answered 429), each counted in
/// `kubelet_api_streaming_sessions` while it lives, run as a task of the
/// node (so shutdown waits for them) and ended when the node stops.
#[derive(Clone)]
pub(crate) struct Sessions {
    gauge: prometheus_client::metrics::gauge::Gauge,
    refused: prometheus_client::metrics::counter::Counter,
    open: Arc<std::sync::atomic::AtomicUsize>,
    limit: usize,
    shutdown: CancellationToken,
    tasks: tokio_util::task::TaskTracker,
}

impl Sessions {
    pub(crate) fn new(
        limit: usize,
        gauge: prometheus_client::metrics::gauge::Gauge,
        refused: prometheus_client::metrics::counter::Counter,
        shutdown: CancellationToken,
        tasks: tokio_util::task::TaskTracker,
    ) -> Self {
        Sessions { gauge, refused, open: Arc::default(), limit, shutdown, tasks }
    }

    /// A place for one more session, or the answer that there is none.
    pub(crate) fn begin(&self) -> Result<SessionGuard, SessionsFull> {
        use std::sync::atomic::Ordering;
        let taken = self.open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
            (open < self.limit && !self.shutdown.is_cancelled()).then_some(open + 1)
        });
        if taken.is_err() {
            self.refused.inc();
            if let Some(left_out) = SESSION_REFUSALS.admit() {
                tracing::warn!(
                    limit = self.limit,
                    left_out,
                    "streaming session refused: the node serves its limit already"
                );
            }
            return Err(SessionsFull { limit: self.limit });
        }
        self.gauge.inc();
        Ok(SessionGuard { gauge: self.gauge.clone(), open: self.open.clone() })
    }

    /// Runs a session's work as a task of the node, holding `guard`,
    /// until it ends or the node stops.
    pub(crate) fn spawn(&self, guard: SessionGuard, work: impl std::future::Future<Output = ()> + Send + 'static) {
        let shutdown = self.shutdown.clone();
        // Not supervised: one streaming session, tracked until it ends or the node stops.
        self.tasks.spawn(async move {
            let _guard = guard;
            tokio::select! {
                () = shutdown.cancelled() => tracing::debug!("streaming session ended: the node is stopping"),
                () = work => {}
            }
        });
    }
}

/// Every streaming session place is taken: answered 429.
#[derive(Debug)]
pub(crate) struct SessionsFull {
    limit: usize,
}

impl IntoResponse for SessionsFull {
    fn into_response(self) -> Response {
        let mut response = text(
            StatusCode::TOO_MANY_REQUESTS,
            format!("too many streaming sessions on this node (the limit is {}); retry later\n", self.limit),
        );
        response.headers_mut().insert(header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        response
    }
}

static SESSION_REFUSALS: super::log_limit::LogLimiter = super::log_limit::LogLimiter::new();

/// One session's place: given back (and uncounted) when dropped.
pub(crate) struct SessionGuard {
    gauge: prometheus_client::metrics::gauge::Gauge,
    open: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.gauge.dec();
        self.open.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

pub(crate) fn text(code: StatusCode, body: String) -> Response {
    (code, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

#[cfg(test)]
mod session_tests {
    use super::*;

    /// Sessions past the limit are refused; a session's place comes back
    /// when it ends; the node's shutdown ends sessions under way (their
    /// work is dropped) and the node's task tracker sees them finish.
    #[tokio::test]
    async fn sessions_are_bounded_and_end_at_shutdown() {
        let gauge = prometheus_client::metrics::gauge::Gauge::default();
        let refused = prometheus_client::metrics::counter::Counter::default();
        let shutdown = CancellationToken::new();
        let tasks = tokio_util::task::TaskTracker::new();
        let sessions = Sessions::new(2, gauge.clone(), refused.clone(), shutdown.clone(), tasks.clone());
        let first = sessions.begin().expect("first");
        let second = sessions.begin().expect("second");
        let full = sessions.begin().err().expect("a third is refused");
        assert_eq!(full.into_response().status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!((gauge.get(), refused.get()), (2, 1));
        drop(first);
        assert_eq!(gauge.get(), 1);
        let again = sessions.begin().expect("a place came back");
        // Two sessions that would run for ever.
        sessions.spawn(second, std::future::pending());
        sessions.spawn(again, std::future::pending());
        shutdown.cancel();
        tasks.close();
        tokio::time::timeout(std::time::Duration::from_secs(60), tasks.wait()).await.expect("sessions end at shutdown");
        assert_eq!(gauge.get(), 0);
        assert!(sessions.begin().is_err(), "no session starts once the node stops");
    }
}
