//! The kubelet API's own series, as upstream's server records them for
//! every request (401s and 403s included, before authentication):
//! `kubelet_http_requests_total`, `kubelet_http_requests_duration_seconds`
//! and `kubelet_http_inflight_requests`, labelled `method` (an unknown
//! method, `PATCH` among them, is `other`), `path` (the first segment of
//! the path, `metrics/<second>` under `/metrics`, `other` for the rest),
//! `server_type` (`readwrite`: this is the authenticated port) and
//! `long_running`.

use std::time::Instant;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use kubelet_support::metrics::DEFAULT_BUCKETS;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: &'static str,
    path: &'static str,
    server_type: &'static str,
    long_running: &'static str,
}

fn histogram() -> Histogram {
    Histogram::new(DEFAULT_BUCKETS)
}

/// The series; clones share their values.
#[derive(Clone)]
pub(crate) struct HttpMetrics {
    requests: Family<RequestLabels, Counter>,
    duration: Family<RequestLabels, Histogram, fn() -> Histogram>,
    inflight: Family<RequestLabels, Gauge>,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        HttpMetrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(histogram),
            inflight: Family::default(),
        }
    }
}

impl HttpMetrics {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "kubelet_http_requests_total",
            "[ALPHA] Number of the http requests received since the server started",
            self.requests.clone(),
        );
        registry.register(
            "kubelet_http_requests_duration_seconds",
            "[ALPHA] Duration in seconds to serve http requests",
            self.duration.clone(),
        );
        registry.register(
            "kubelet_http_inflight_requests",
            "[ALPHA] Number of the inflight http requests",
            self.inflight.clone(),
        );
    }
}

/// Upstream's method bucket.
fn method(method: &http::Method) -> &'static str {
    match method.as_str() {
        "OPTIONS" => "OPTIONS",
        "GET" => "GET",
        "HEAD" => "HEAD",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "TRACE" => "TRACE",
        "CONNECT" => "CONNECT",
        _ => "other",
    }
}

/// Upstream's path bucket: the first segment, or `metrics/<second>`, if
/// the kubelet serves it; else `other`.
fn path(path: &str) -> &'static str {
    let mut segments = path.trim_start_matches('/').split('/');
    let first = segments.next().unwrap_or_default();
    let root = if first == "metrics" {
        match segments.next() {
            Some("cadvisor") => "metrics/cadvisor",
            Some("probes") => "metrics/probes",
            Some("resource") => "metrics/resource",
            Some("") | None => "metrics",
            Some(_) => "other",
        }
    } else {
        first
    };
    const ROOTS: [&str; 16] = [
        "healthz",
        "pods",
        "stats",
        "metrics",
        "metrics/cadvisor",
        "metrics/probes",
        "metrics/resource",
        "checkpoint",
        "run",
        "exec",
        "attach",
        "portForward",
        "containerLogs",
        "configz",
        "runningpods",
        "logs",
    ];
    ROOTS.iter().find(|r| **r == root).copied().unwrap_or("other")
}

/// The middleware: counts, times and tracks each request in flight.
pub(crate) async fn record(State(metrics): State<HttpMetrics>, request: Request, next: Next) -> Response {
    let path = path(request.uri().path());
    let labels = RequestLabels {
        method: method(request.method()),
        path,
        server_type: "readwrite",
        // As upstream (whose lookup is `portforward`, so `portForward`
        // requests are not long-running).
        long_running: if matches!(path, "exec" | "attach") { "true" } else { "false" },
    };
    metrics.requests.get_or_create(&labels).inc();
    let inflight = metrics.inflight.get_or_create(&labels).clone();
    inflight.inc();
    let began = Instant::now();
    let response = next.run(request).await;
    inflight.dec();
    metrics.duration.get_or_create(&labels).observe(began.elapsed().as_secs_f64());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_bucketed_as_upstream() {
        assert_eq!(path("/metrics"), "metrics");
        assert_eq!(path("/metrics/cadvisor"), "metrics/cadvisor");
        assert_eq!(path("/metrics/slis"), "other");
        assert_eq!(path("/stats/summary"), "stats");
        assert_eq!(path("/healthz/syncloop"), "healthz");
        assert_eq!(path("/containerLogs/ns/pod/c"), "containerLogs");
        assert_eq!(path("/nothing/here"), "other");
        assert_eq!(method(&http::Method::PATCH), "other");
        assert_eq!(method(&http::Method::GET), "GET");
    }
}
