//! The series of the node's dealings with the API server, with upstream's
//! names (client-go's REST client metrics and the kubelet's certificate
//! managers):
//! - `rest_client_requests_total{code,host,method}` and
//!   `rest_client_request_duration_seconds{verb,host}`: every request a
//!   client built from a kubeconfig sends ([`RestClientLayer`]); `code` is
//!   the HTTP status, or `<error>` when no answer came;
//! - `kubelet_certificate_manager_client_ttl_seconds`: seconds until the
//!   client certificate expires (`+Inf` when none is known: a token, or a
//!   certificate the node does not rotate);
//! - `kubelet_certificate_manager_client_expiration_renew_errors`: failed
//!   renewals of the client certificate;
//! - `kubelet_certificate_manager_server_ttl_seconds` and
//!   `kubelet_server_expiration_renew_errors`: the same for the serving
//!   certificate the node requests (`--rotate-server-certificates`).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use kubelet_support::metrics::ScrapeFamily;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    code: String,
    host: String,
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    verb: String,
    host: String,
}

/// client-go's request latency buckets.
fn request_histogram() -> Histogram {
    Histogram::new([0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0])
}

/// The series; clones share their values.
#[derive(Clone)]
pub struct ApiMetrics {
    requests: Family<RequestLabels, Counter>,
    duration: Family<DurationLabels, Histogram, fn() -> Histogram>,
    client_not_after: Arc<Mutex<Option<jiff::Timestamp>>>,
    client_renew_errors: Counter,
    server_not_after: Arc<Mutex<Option<jiff::Timestamp>>>,
    server_renew_errors: Counter,
}

impl Default for ApiMetrics {
    fn default() -> Self {
        ApiMetrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(request_histogram),
            client_not_after: Arc::default(),
            client_renew_errors: Counter::default(),
            server_not_after: Arc::default(),
            server_renew_errors: Counter::default(),
        }
    }
}

impl std::fmt::Debug for ApiMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiMetrics").finish_non_exhaustive()
    }
}

fn ttl(not_after: &Mutex<Option<jiff::Timestamp>>) -> f64 {
    match *not_after.lock().unwrap_or_else(|p| p.into_inner()) {
        // Whole seconds, as upstream truncates them.
        Some(at) => (at.as_second() - jiff::Timestamp::now().as_second()) as f64,
        None => f64::INFINITY,
    }
}

impl ApiMetrics {
    /// Registers the series into `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "rest_client_requests_total",
            "[ALPHA] Number of HTTP requests, partitioned by status code, method, and host.",
            self.requests.clone(),
        );
        registry.register(
            "rest_client_request_duration_seconds",
            "[ALPHA] Request latency in seconds. Broken down by verb, and host.",
            self.duration.clone(),
        );
        let client = Arc::clone(&self.client_not_after);
        registry.register_collector(ScrapeFamily::gauge(
            "kubelet_certificate_manager_client_ttl_seconds",
            "[ALPHA] Gauge of the TTL (time-to-live) of the Kubelet's client certificate. The value is in seconds \
             until certificate expiry (negative if already expired). If client certificate is invalid or unused, \
             the value will be +INF.",
            &[],
            move || vec![(Vec::new(), ttl(&client))],
        ));
        registry.register(
            "kubelet_certificate_manager_client_expiration_renew_errors",
            "[ALPHA] Counter of certificate renewal errors.",
            self.client_renew_errors.clone(),
        );
        let server = Arc::clone(&self.server_not_after);
        registry.register_collector(ScrapeFamily::gauge(
            "kubelet_certificate_manager_server_ttl_seconds",
            "[ALPHA] Gauge of the shortest TTL (time-to-live) of the Kubelet's serving certificate. The value is in \
             seconds until certificate expiry (negative if already expired). If serving certificate is invalid or \
             unused, the value will be +INF.",
            &[],
            move || vec![(Vec::new(), ttl(&server))],
        ));
        registry.register(
            "kubelet_server_expiration_renew_errors",
            "[ALPHA] Counter of certificate renewal errors.",
            self.server_renew_errors.clone(),
        );
    }

    /// The client certificate in use expires at `not_after`.
    pub(crate) fn client_certificate(&self, not_after: jiff::Timestamp) {
        *self.client_not_after.lock().unwrap_or_else(|p| p.into_inner()) = Some(not_after);
    }

    /// A renewal of the client certificate failed.
    pub(crate) fn client_renewal_failed(&self) {
        self.client_renew_errors.inc();
    }

    /// The serving certificate in use expires at `not_after`.
    pub fn server_certificate(&self, not_after: jiff::Timestamp) {
        *self.server_not_after.lock().unwrap_or_else(|p| p.into_inner()) = Some(not_after);
    }

    /// A renewal (or the first request) of the serving certificate failed.
    pub fn server_renewal_failed(&self) {
        self.server_renew_errors.inc();
    }

    /// A layer counting the requests of a client of the API server at `host`
    /// (`host[:port]`, as the kubeconfig names it).
    pub(crate) fn layer(&self, host: String) -> RestClientLayer {
        RestClientLayer { metrics: self.clone(), host: Arc::from(host) }
    }
}

/// Counts and times each request (`kube::client::ClientBuilder::with_layer`).
#[derive(Clone, Debug)]
pub(crate) struct RestClientLayer {
    metrics: ApiMetrics,
    host: Arc<str>,
}

impl<S> tower::Layer<S> for RestClientLayer {
    type Service = RestClient<S>;

    fn layer(&self, inner: S) -> RestClient<S> {
        RestClient { inner, metrics: self.metrics.clone(), host: Arc::clone(&self.host) }
    }
}

/// The service [`RestClientLayer`] makes.
#[derive(Clone, Debug)]
pub(crate) struct RestClient<S> {
    inner: S,
    metrics: ApiMetrics,
    host: Arc<str>,
}

impl<S, B, R> tower::Service<http::Request<B>> for RestClient<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request.method().as_str().to_owned();
        let (metrics, host) = (self.metrics.clone(), Arc::clone(&self.host));
        let began = Instant::now();
        let call = self.inner.call(request);
        Box::pin(async move {
            let answer = call.await;
            let code = match &answer {
                Ok(response) => response.status().as_u16().to_string(),
                Err(_) => "<error>".to_owned(),
            };
            metrics
                .requests
                .get_or_create(&RequestLabels { code, host: host.to_string(), method: method.clone() })
                .inc();
            metrics
                .duration
                .get_or_create(&DurationLabels { verb: method, host: host.to_string() })
                .observe(began.elapsed().as_secs_f64());
            answer
        })
    }
}

/// `host[:port]` of a cluster URL, as client-go labels requests.
pub(crate) fn url_host(url: &http::Uri) -> String {
    url.authority().map(|a| a.as_str().to_owned()).unwrap_or_else(|| "none".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn requests_are_counted_by_code_method_and_host() {
        use tower::{Layer, Service, ServiceExt};
        let metrics = ApiMetrics::default();
        let service = tower::service_fn(|request: http::Request<()>| async move {
            let status = if request.uri().path() == "/missing" { 404 } else { 200 };
            Ok::<_, std::convert::Infallible>(http::Response::builder().status(status).body(()).expect("a response"))
        });
        let mut client = metrics.layer("10.0.0.1:6443".into()).layer(service);
        for path in ["/api", "/missing", "/api"] {
            let request = http::Request::get(path).body(()).expect("a request");
            client.ready().await.expect("ready").call(request).await.expect("answered");
        }
        metrics.client_certificate(jiff::Timestamp::now() + jiff::SignedDuration::from_hours(2));
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let text = kubelet_support::metrics::encode_text(&registry).expect("encodes");
        assert!(
            text.contains("rest_client_requests_total{code=\"200\",host=\"10.0.0.1:6443\",method=\"GET\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("rest_client_requests_total{code=\"404\",host=\"10.0.0.1:6443\",method=\"GET\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("rest_client_request_duration_seconds_count{verb=\"GET\",host=\"10.0.0.1:6443\"} 3\n"),
            "{text}"
        );
        let ttl: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("kubelet_certificate_manager_client_ttl_seconds "))
            .and_then(|v| v.parse().ok())
            .expect("a client ttl");
        assert!((7100.0..=7200.0).contains(&ttl), "{ttl}");
        assert!(text.contains("kubelet_certificate_manager_server_ttl_seconds +Inf\n"), "{text}");
        assert!(text.contains("kubelet_certificate_manager_client_expiration_renew_errors 0\n"), "{text}");
    }
}
