//! Who is asking, and may they: the kubelet API's authentication (client
//! certificates, bearer tokens by TokenReview, anonymous) and
//! authorization (SubjectAccessReview on the node's `nodes` subresources,
//! or everything allowed), with upstream's request mapping and caches.
//!
//! Reviews are bounded, since any client that reaches the port can make
//! the node send one (a new random token is a new TokenReview): at most
//! [`REVIEWS_IN_FLIGHT`] at once, a request waiting at most
//! [`REVIEW_QUEUE_WAIT`] for its turn (then `429 Too Many Requests`), each
//! answer within [`REVIEW_DEADLINE`], through a client of their own (its
//! own connections and request bucket: the node's Lease and status never
//! wait behind them). Tokens are cached by their SHA-256, never as
//! themselves; a token the API did not authenticate is remembered as such
//! for [`FAILED_TOKEN_TTL`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use tokio::sync::watch;

/// Who made a request.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct User {
    /// The user name (`system:anonymous` for anonymous requests).
    pub name: String,
    /// The user's uid, if known.
    pub uid: Option<String>,
    /// The groups (`system:authenticated` or `system:unauthenticated`
    /// included).
    pub groups: Vec<String>,
}

impl User {
    fn anonymous() -> User {
        User { name: "system:anonymous".into(), uid: None, groups: vec!["system:unauthenticated".into()] }
    }

    /// The user of a verified client certificate: its common name, its
    /// organizations as groups.
    pub(crate) fn from_certificate(der: &[u8]) -> Option<User> {
        let facts = crate::pki::x509::certificate_facts(der).ok()?;
        let name = facts.common_name.filter(|n| !n.is_empty())?;
        let mut groups = facts.organizations;
        groups.push("system:authenticated".into());
        Some(User { name, uid: None, groups })
    }
}

/// The identity a TLS connection proved with its client certificate, put
/// on each of its requests.
#[derive(Clone, Debug, Default)]
pub(super) struct PeerIdentity(pub(super) Option<User>);

/// How requests are authorized (`--authorization-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthorizationMode {
    /// Everything any authenticated (or allowed anonymous) client asks.
    AlwaysAllow,
    /// A SubjectAccessReview per request (cached).
    Webhook,
}

/// The authentication and authorization settings.
#[derive(Clone, Debug)]
pub struct AuthSettings {
    /// Anonymous requests are served (as `system:anonymous`) rather than
    /// refused with 401 (`--anonymous-auth`).
    pub anonymous: bool,
    /// Bearer tokens are checked with a TokenReview
    /// (`--authentication-token-webhook`).
    pub token_webhook: bool,
    /// How long a TokenReview answer is reused.
    pub token_cache_ttl: Duration,
    /// How requests are authorized.
    pub authorization: AuthorizationMode,
    /// How long an allowed SubjectAccessReview answer is reused.
    pub authorized_ttl: Duration,
    /// How long a denied one is reused.
    pub unauthorized_ttl: Duration,
}

impl Default for AuthSettings {
    /// Upstream's configuration-file defaults: no anonymous requests, the
    /// token webhook on (2 min cache), Webhook authorization (allowed
    /// answers cached 5 min, denied 30 s).
    fn default() -> Self {
        AuthSettings {
            anonymous: false,
            token_webhook: true,
            token_cache_ttl: Duration::from_secs(120),
            authorization: AuthorizationMode::Webhook,
            authorized_ttl: Duration::from_secs(300),
            unauthorized_ttl: Duration::from_secs(30),
        }
    }
}

/// What a request asks of the node, as the kubelet maps it for
/// authorization: a verb on a subresource of `nodes/<node>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct NodeRequest {
    /// get, create, update, patch, delete.
    pub verb: &'static str,
    /// stats, metrics, log, spec, checkpoint or proxy.
    pub subresource: &'static str,
}

/// The paths that open a session in a container (and `/run`, which
/// upstream serves and this node does not).
const STREAMING_PREFIXES: [&str; 4] = ["/exec", "/attach", "/portForward", "/run"];

/// Whether `path` is one of the streaming endpoints.
fn is_streaming(path: &str) -> bool {
    STREAMING_PREFIXES.iter().any(|prefix| path == *prefix || path.starts_with(&format!("{prefix}/")))
}

/// Upstream's mapping of a request to its attributes, but for the
/// streaming endpoints: `/exec`, `/attach`, `/portForward` and `/run` are
/// `create` whatever the method. (Upstream maps the method, so a GET,
/// which is how a WebSocket upgrade arrives, is `get`, and anyone allowed
/// `get nodes/proxy` can open a session in any container.)
pub(crate) fn node_request(method: &Method, path: &str) -> NodeRequest {
    let verb = match *method {
        _ if is_streaming(path) => "create",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "get",
    };
    let under = |prefix: &str| path == prefix || path.starts_with(&format!("{prefix}/"));
    let subresource = if under("/stats") {
        "stats"
    } else if under("/metrics") {
        "metrics"
    } else if under("/logs") {
        "log"
    } else if under("/spec") {
        "spec"
    } else if under("/checkpoint") {
        "checkpoint"
    } else {
        "proxy"
    };
    NodeRequest { verb, subresource }
}

/// The fine-grained subresource a path is checked against first (upstream
/// 1.33's `KubeletFineGrainedAuthz`, on by default): `/pods` and
/// `/runningpods/` are `pods`, `/healthz` `healthz`, `/configz` `configz`;
/// where it is refused, the path's own subresource (`proxy`) decides.
pub(crate) fn fine_grained(path: &str) -> Option<&'static str> {
    let under = |prefix: &str| path == prefix || path.starts_with(&format!("{prefix}/"));
    if under("/pods") || under("/runningpods") {
        Some("pods")
    } else if under("/healthz") {
        Some("healthz")
    } else if under("/configz") {
        Some("configz")
    } else {
        None
    }
}

/// An answer kept until it expires.
struct Cached<T> {
    value: T,
    until: Instant,
}

/// A small expiring cache; bounded (the oldest half goes when full).
struct Cache<K, V> {
    entries: Mutex<HashMap<K, Cached<V>>>,
}

const CACHE_LIMIT: usize = 4096;
/// Bearer tokens longer than this are refused without a TokenReview.
const MAX_TOKEN: usize = 8 * 1024;
/// Reviews (TokenReview and SubjectAccessReview) under way at once at most.
pub(crate) const REVIEWS_IN_FLIGHT: usize = 16;
/// How long a request waits for a review slot before it is answered 429.
pub(crate) const REVIEW_QUEUE_WAIT: Duration = Duration::from_secs(5);
/// How long one review may take before the request is answered 503.
pub(crate) const REVIEW_DEADLINE: Duration = Duration::from_secs(10);
/// How long a token the API did not authenticate is refused without
/// asking again.
pub(crate) const FAILED_TOKEN_TTL: Duration = Duration::from_secs(10);

/// A token's cache key: its SHA-256 (a cache, a heap dump or a debug print
/// then holds no token).
type TokenKey = [u8; 32];

fn token_key(token: &str) -> TokenKey {
    use sha2::Digest as _;
    sha2::Sha256::digest(token.as_bytes()).into()
}

impl<K: std::hash::Hash + Eq + Clone, V: Clone> Cache<K, V> {
    fn new() -> Self {
        Cache { entries: Mutex::new(HashMap::new()) }
    }

    fn get(&self, key: &K) -> Option<V> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.get(key).filter(|c| c.until > Instant::now()).map(|c| c.value.clone())
    }

    fn put(&self, key: K, value: V, ttl: Duration) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() >= CACHE_LIMIT {
            let now = Instant::now();
            entries.retain(|_, c| c.until > now);
            if entries.len() >= CACHE_LIMIT {
                let mut ends: Vec<Instant> = entries.values().map(|c| c.until).collect();
                ends.sort_unstable();
                let cut = ends[ends.len() / 2];
                entries.retain(|_, c| c.until > cut);
            }
        }
        entries.insert(key, Cached { value, until: Instant::now() + ttl });
    }
}

/// The authenticator and authorizer, shared by every connection.
#[derive(Clone)]
pub(super) struct Auth {
    inner: Arc<AuthInner>,
}

struct AuthInner {
    settings: AuthSettings,
    node_name: String,
    client: watch::Receiver<Option<kube::Client>>,
    tokens: Cache<TokenKey, Option<User>>,
    decisions: Cache<(User, NodeRequest), Decision>,
    /// Review slots ([`REVIEWS_IN_FLIGHT`]).
    reviews: tokio::sync::Semaphore,
}

#[derive(Clone, Debug)]
enum Decision {
    Allowed,
    Denied(String),
}

/// Why a request was not served.
#[derive(Debug)]
enum Refusal {
    Unauthorized,
    Forbidden(String),
    Unavailable(String),
    /// Every review slot stayed busy for [`REVIEW_QUEUE_WAIT`].
    Busy,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let (code, body) = match self {
            Refusal::Unauthorized => (StatusCode::UNAUTHORIZED, "Unauthorized".to_owned()),
            Refusal::Forbidden(message) => (StatusCode::FORBIDDEN, message),
            Refusal::Unavailable(message) => (StatusCode::SERVICE_UNAVAILABLE, message),
            Refusal::Busy => {
                let mut response = (
                    StatusCode::TOO_MANY_REQUESTS,
                    [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                    "too many requests are being authenticated or authorized; retry later",
                )
                    .into_response();
                response.headers_mut().insert(header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
                return response;
            }
        };
        (code, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
    }
}

impl Auth {
    pub(super) fn new(settings: AuthSettings, node_name: &str, client: watch::Receiver<Option<kube::Client>>) -> Self {
        Auth {
            inner: Arc::new(AuthInner {
                settings,
                node_name: node_name.to_owned(),
                client,
                tokens: Cache::new(),
                decisions: Cache::new(),
                reviews: tokio::sync::Semaphore::new(REVIEWS_IN_FLIGHT),
            }),
        }
    }

    fn client(&self) -> Result<kube::Client, Refusal> {
        self.inner.client.borrow().clone().ok_or_else(|| {
            Refusal::Unavailable("not connected to the API server yet; cannot check this request".into())
        })
    }

    async fn authenticate(&self, peer: Option<&User>, headers: &HeaderMap) -> Result<User, Refusal> {
        if let Some(user) = peer {
            return Ok(user.clone());
        }
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' ').filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer")))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty());
        if let Some(token) = bearer {
            // A token this long is no token (and would bloat the cache).
            if !self.inner.settings.token_webhook || token.len() > MAX_TOKEN {
                return Err(Refusal::Unauthorized);
            }
            return self.review_token(token).await?.ok_or(Refusal::Unauthorized);
        }
        if self.inner.settings.anonymous { Ok(User::anonymous()) } else { Err(Refusal::Unauthorized) }
    }

    /// Creates `review` within the review bounds: a slot (waiting at most
    /// [`REVIEW_QUEUE_WAIT`]), an answer within [`REVIEW_DEADLINE`].
    async fn bounded_review<K>(&self, review: &K, what: &str) -> Result<K, Refusal>
    where
        K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope, DynamicType = ()>
            + Clone
            + serde::Serialize
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let client = self.client()?;
        let slot = tokio::time::timeout(REVIEW_QUEUE_WAIT, self.inner.reviews.acquire()).await;
        let Ok(Ok(_slot)) = slot else {
            if let Some(left_out) = BUSY_WARNINGS.admit() {
                tracing::warn!(
                    in_flight = REVIEWS_IN_FLIGHT,
                    waited = ?REVIEW_QUEUE_WAIT,
                    left_out,
                    "kubelet API: every review slot is busy; refusing requests with 429"
                );
            }
            return Err(Refusal::Busy);
        };
        let api: kube::Api<K> = kube::Api::all(client);
        match tokio::time::timeout(REVIEW_DEADLINE, api.create(&kube::api::PostParams::default(), review)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(error)) => {
                tracing::warn!(%error, "{what} failed");
                Err(Refusal::Unavailable(format!("cannot check the request ({what}): {error}")))
            }
            Err(_) => {
                tracing::warn!(deadline = ?REVIEW_DEADLINE, "{what} got no answer in time");
                Err(Refusal::Unavailable(format!("cannot check the request: {what} got no answer in time")))
            }
        }
    }

    async fn review_token(&self, token: &str) -> Result<Option<User>, Refusal> {
        let key = token_key(token);
        if let Some(known) = self.inner.tokens.get(&key) {
            return Ok(known);
        }
        let review = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_owned()), audiences: None },
            ..TokenReview::default()
        };
        let answer = self.bounded_review(&review, "TokenReview").await?;
        let status = answer.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(info)) => {
                let mut groups = info.groups.unwrap_or_default();
                if !groups.iter().any(|g| g == "system:authenticated") {
                    groups.push("system:authenticated".into());
                }
                Some(User { name: info.username.unwrap_or_default(), uid: info.uid, groups })
            }
            _ => None,
        };
        let ttl = match user {
            Some(_) => self.inner.settings.token_cache_ttl,
            None => FAILED_TOKEN_TTL.min(self.inner.settings.token_cache_ttl),
        };
        self.inner.tokens.put(key, user.clone(), ttl);
        Ok(user)
    }

    async fn authorize(&self, user: &User, request: &NodeRequest) -> Result<(), Refusal> {
        if self.inner.settings.authorization == AuthorizationMode::AlwaysAllow {
            return Ok(());
        }
        let key = (user.clone(), request.clone());
        let decision = match self.inner.decisions.get(&key) {
            Some(decision) => decision,
            None => {
                let decision = self.review_access(user, request).await?;
                let ttl = match decision {
                    Decision::Allowed => self.inner.settings.authorized_ttl,
                    Decision::Denied(_) => self.inner.settings.unauthorized_ttl,
                };
                self.inner.decisions.put(key, decision.clone(), ttl);
                decision
            }
        };
        match decision {
            Decision::Allowed => Ok(()),
            Decision::Denied(reason) => {
                let mut message = format!(
                    "Forbidden (user={}, verb={}, resource=nodes, subresource={})",
                    user.name, request.verb, request.subresource
                );
                if !reason.is_empty() {
                    message.push_str(&format!(": {reason}"));
                }
                Err(Refusal::Forbidden(message))
            }
        }
    }

    /// 1.33's fine-grained authorization: `request` as its fine-grained
    /// subresource first (`nodes/pods`, `nodes/healthz`, `nodes/configz`),
    /// where the path has one, then as what the path maps to
    /// (`nodes/proxy`); a denial names both.
    async fn authorize_path(
        &self,
        user: &User,
        request: &NodeRequest,
        fine: Option<&'static str>,
    ) -> Result<(), Refusal> {
        let Some(fine) = fine else { return self.authorize(user, request).await };
        match self.authorize(user, &NodeRequest { subresource: fine, ..request.clone() }).await {
            Err(Refusal::Forbidden(_)) => {}
            decided => return decided,
        }
        match self.authorize(user, request).await {
            Err(Refusal::Forbidden(_)) => Err(Refusal::Forbidden(format!(
                "Forbidden (user={}, verb={}, resource=nodes, subresource(s)=[{fine} {}])",
                user.name, request.verb, request.subresource
            ))),
            decided => decided,
        }
    }

    async fn review_access(&self, user: &User, request: &NodeRequest) -> Result<Decision, Refusal> {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.name.clone()),
                uid: user.uid.clone(),
                groups: Some(user.groups.clone()),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(request.verb.to_owned()),
                    group: Some(String::new()),
                    version: Some("v1".to_owned()),
                    resource: Some("nodes".to_owned()),
                    subresource: Some(request.subresource.to_owned()),
                    name: Some(self.inner.node_name.clone()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let answer = self.bounded_review(&review, "SubjectAccessReview").await?;
        let status = answer.status.unwrap_or_default();
        Ok(if status.allowed { Decision::Allowed } else { Decision::Denied(status.reason.unwrap_or_default()) })
    }
}

static BUSY_WARNINGS: super::log_limit::LogLimiter = super::log_limit::LogLimiter::new();

/// A streaming endpoint asked with a method it does not serve (it serves
/// GET, for WebSocket upgrades, and POST, for SPDY): 405, before anything
/// else is done for the request.
fn method_refused(method: &Method, path: &str) -> Option<Response> {
    if !is_streaming(path) || *method == Method::GET || *method == Method::POST {
        return None;
    }
    let mut response = (StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not allowed on {path}\n")).into_response();
    response.headers_mut().insert(header::ALLOW, axum::http::HeaderValue::from_static("GET, POST"));
    Some(response)
}

/// The middleware: authenticates, authorizes, then serves.
pub(super) async fn check(State(auth): State<Auth>, request: Request, next: Next) -> Response {
    if let Some(refused) = method_refused(request.method(), request.uri().path()) {
        return refused;
    }
    let peer = request.extensions().get::<PeerIdentity>().and_then(|p| p.0.clone());
    let user = match auth.authenticate(peer.as_ref(), request.headers()).await {
        Ok(user) => user,
        Err(refusal) => {
            tracing::debug!(path = %request.uri().path(), ?refusal, "request not authenticated");
            return refusal.into_response();
        }
    };
    let attributes = node_request(request.method(), request.uri().path());
    let decided = auth.authorize_path(&user, &attributes, fine_grained(request.uri().path())).await;
    if let Err(refusal) = decided {
        tracing::debug!(user = %user.name, path = %request.uri().path(), ?refusal, "request not authorized");
        return refusal.into_response();
    }
    tracing::trace!(user = %user.name, method = %request.method(), path = %request.uri().path(), "kubelet API request");
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_map_to_node_subresources_as_upstream() {
        let get = |path| node_request(&Method::GET, path);
        assert_eq!(get("/stats/summary"), NodeRequest { verb: "get", subresource: "stats" });
        assert_eq!(get("/stats"), NodeRequest { verb: "get", subresource: "stats" });
        assert_eq!(get("/metrics/resource"), NodeRequest { verb: "get", subresource: "metrics" });
        assert_eq!(get("/logs/syslog"), NodeRequest { verb: "get", subresource: "log" });
        assert_eq!(get("/spec/"), NodeRequest { verb: "get", subresource: "spec" });
        assert_eq!(get("/pods"), NodeRequest { verb: "get", subresource: "proxy" });
        assert_eq!(get("/statsfoo"), NodeRequest { verb: "get", subresource: "proxy" });
        assert_eq!(get("/containerLogs/a/b/c"), NodeRequest { verb: "get", subresource: "proxy" });
        assert_eq!(node_request(&Method::HEAD, "/pods").verb, "get");
        assert_eq!(node_request(&Method::POST, "/exec/a/b/c").verb, "create");
        // Better than upstream: a session is `create` whatever the method
        // (a WebSocket upgrade is a GET).
        for path in ["/exec/a/b/c", "/attach/a/b/c", "/portForward/a/b", "/run/a/b/c", "/exec"] {
            assert_eq!(get(path), NodeRequest { verb: "create", subresource: "proxy" }, "{path}");
        }
        assert_eq!(get("/executive"), NodeRequest { verb: "get", subresource: "proxy" });
        assert_eq!(node_request(&Method::PUT, "/x").verb, "update");
        assert_eq!(node_request(&Method::PATCH, "/x").verb, "patch");
        assert_eq!(node_request(&Method::DELETE, "/x").verb, "delete");
    }

    #[test]
    fn pods_healthz_and_configz_have_their_own_subresources_first() {
        assert_eq!(fine_grained("/pods"), Some("pods"));
        assert_eq!(fine_grained("/runningpods/"), Some("pods"));
        assert_eq!(fine_grained("/healthz"), Some("healthz"));
        assert_eq!(fine_grained("/healthz/ping"), Some("healthz"));
        assert_eq!(fine_grained("/configz"), Some("configz"));
        assert_eq!(fine_grained("/podsx"), None);
        assert_eq!(fine_grained("/containerLogs/a/b/c"), None);
        assert_eq!(fine_grained("/stats/summary"), None);
    }

    #[test]
    fn streaming_endpoints_refuse_methods_they_do_not_serve() {
        for method in [Method::PUT, Method::DELETE, Method::PATCH, Method::HEAD, Method::OPTIONS] {
            let refused = method_refused(&method, "/exec/a/b/c").expect("refused");
            assert_eq!(refused.status(), StatusCode::METHOD_NOT_ALLOWED, "{method}");
            assert_eq!(refused.headers()[header::ALLOW], "GET, POST");
        }
        assert!(method_refused(&Method::GET, "/exec/a/b/c").is_none());
        assert!(method_refused(&Method::POST, "/portForward/a/b").is_none());
        assert!(method_refused(&Method::DELETE, "/pods").is_none(), "not a streaming endpoint");
    }

    #[test]
    fn the_cache_expires_and_stays_bounded() {
        let cache: Cache<u32, u32> = Cache::new();
        cache.put(1, 10, Duration::from_secs(60));
        cache.put(2, 20, Duration::ZERO);
        assert_eq!(cache.get(&1), Some(10));
        assert_eq!(cache.get(&2), None, "expired at once");
        for i in 0..(CACHE_LIMIT as u32 * 2) {
            cache.put(i, i, Duration::from_secs(60));
        }
        assert!(cache.entries.lock().expect("lock").len() <= CACHE_LIMIT);
    }

    /// Fuzz target: request lines (method and path) mapped to what they
    /// ask of the node: every path maps to a verb and subresource; the
    /// streaming ones are `create` whatever the method.
    #[test]
    fn fuzz_request_mapping() {
        let ran = crate::fuzz::Fuzz::new("kubelet-api-requests").run(|input| {
            let text = String::from_utf8_lossy(input);
            let (method, rest) = text.split_once(' ').unwrap_or(("GET", &text));
            let path = rest.split('?').next().unwrap_or_default().trim_end();
            let Ok(method) = Method::from_bytes(method.as_bytes()) else { return };
            let mapped = node_request(&method, path);
            if is_streaming(path) {
                assert_eq!(mapped.verb, "create", "{path}");
            }
            let _ = method_refused(&method, path);
        });
        assert!(ran > 3);
    }
}
