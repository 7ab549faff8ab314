//! A small Kubernetes API server, in process, for cluster-mode tests where
//! no real one can be installed. It speaks the real HTTP API (JSON) for the
//! resources a node uses (see `store::RESOURCES`) with the semantics a
//! client depends on:
//! - one resourceVersion counter; every write makes a new version; a write
//!   that changes nothing does not;
//! - create (409 `AlreadyExists`, `generateName`), get, list (label and
//!   field selectors), watch (from a resourceVersion, resumed from a
//!   bounded history; 410 `Expired` once compacted; from no version, the
//!   current objects as `ADDED` first), replace (409 `Conflict` on a stale
//!   resourceVersion), merge patch and JSON patch (a `test` operation or a
//!   `metadata.resourceVersion` in a merge patch is a precondition),
//!   status subresources, delete (preconditions on uid and
//!   resourceVersion; pods bound to a node are marked terminating with
//!   their grace period unless it is 0), service account tokens;
//! - bearer-token identities, with the Node authorizer's rules for node
//!   identities (`auth`);
//! - fault injection: answers with a chosen status, slow answers, dropped
//!   watches, compaction.
//!
//! Strategic merge patches are taken for pods and nodes (status
//! conditions merge by type, pod IPs by ip, `$patch: replace` replaces a
//! list: what the node's status writes use); other strategic merge patches
//! and server-side apply are refused with 415.

pub mod auth;
pub mod resize;
pub mod store;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc, watch};
use tokio_util::sync::CancellationToken;

pub use auth::Identity;
use kubelet_api::resource::{self as resource_api, ResourceVersion};
use store::{ApiError, Change, EventType, Key, Resource, Selector, Store, rv_of};

/// An injected fault: requests whose method and path match are answered
/// with `status` (after `delay`), `times` times.
#[derive(Debug, Clone)]
pub struct Fault {
    /// Only this method (any when `None`).
    pub method: Option<Method>,
    /// Only paths containing this.
    pub path_contains: String,
    /// The status to answer with (0: answer normally, after the delay).
    pub status: u16,
    /// A delay before answering.
    pub delay: Duration,
    /// How many requests it applies to.
    pub times: usize,
}

impl Fault {
    /// Answers `times` requests matching `method` and `path_contains` with `status`.
    pub fn status(method: Option<Method>, path_contains: &str, status: u16, times: usize) -> Fault {
        Fault { method, path_contains: path_contains.to_owned(), status, delay: Duration::ZERO, times }
    }

    /// Delays `times` matching requests by `delay`, then answers them normally.
    pub fn slow(method: Option<Method>, path_contains: &str, delay: Duration, times: usize) -> Fault {
        Fault { method, path_contains: path_contains.to_owned(), status: 0, delay, times }
    }
}

/// One request the server received.
#[derive(Debug, Clone)]
pub struct Logged {
    /// Method.
    pub method: Method,
    /// Path and query.
    pub uri: String,
    /// The status answered.
    pub status: u16,
    /// When it arrived.
    pub received: std::time::Instant,
    /// The body of a patch (for tests that look at what was sent).
    pub body: Option<String>,
    /// Who sent it (`system:node:<name>`, the administrator's name), if
    /// its token is known.
    pub user: Option<String>,
}

struct Shared {
    store: Mutex<Store>,
    faults: Mutex<Vec<Fault>>,
    tokens: Mutex<HashMap<String, Identity>>,
    drop_watches: watch::Sender<u64>,
    log: Mutex<Vec<Logged>>,
    /// How many requests are in `log` (to wait on).
    logged: watch::Sender<usize>,
    token_serial: AtomicU64,
    /// The versions of `resource.k8s.io` served (all three unless a test
    /// says otherwise, as a 1.33 server with the betas on serves two).
    resource_versions: Mutex<Vec<ResourceVersion>>,
    /// The minor version `/version` answers (`1.<minor>.0`).
    minor: std::sync::atomic::AtomicU32,
}

impl Shared {
    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `resource` is served (a `resource.k8s.io` version may not
    /// be).
    fn serves(&self, resource: &Resource) -> bool {
        resource.group != resource_api::GROUP
            || ResourceVersion::parse(resource.version)
                .is_some_and(|v| self.resource_versions.lock().unwrap_or_else(|p| p.into_inner()).contains(&v))
    }
}

/// A running fake API server.
pub struct ApiServer {
    address: SocketAddr,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    admin_token: String,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Writes a kubeconfig for the API at `url` with bearer `token` at `path`
/// (tokens are `node-token-<node>` for node identities, see
/// [`ApiServer::node_token`]).
pub fn write_kubeconfig(path: &Path, url: &str, token: &str) -> std::io::Result<()> {
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\nusers:\n- name: user\n  \
             user:\n    token: {token}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: user\n\
             current-context: fake\n"
        ),
    )
}

fn status_response(error: &ApiError) -> Response {
    let code = StatusCode::from_u16(error.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, [(header::CONTENT_TYPE, "application/json")], error.status().to_string()).into_response()
}

fn object_response(code: StatusCode, object: &Value) -> Response {
    (code, [(header::CONTENT_TYPE, "application/json")], object.to_string()).into_response()
}

impl ApiServer {
    /// Starts a server on a free loopback port.
    pub async fn start() -> std::io::Result<ApiServer> {
        ApiServer::start_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Starts a server on `address` (say, one a node was told about before
    /// the API came up).
    pub async fn start_on(address: SocketAddr) -> std::io::Result<ApiServer> {
        let listener = tokio::net::TcpListener::bind(address).await?;
        let address = listener.local_addr()?;
        let admin_token = "admin-token".to_owned();
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            faults: Mutex::default(),
            tokens: Mutex::new(HashMap::from([(admin_token.clone(), Identity::Admin)])),
            drop_watches: watch::channel(0).0,
            log: Mutex::default(),
            logged: watch::channel(0).0,
            token_serial: AtomicU64::new(0),
            resource_versions: Mutex::new(ResourceVersion::PREFERENCE.to_vec()),
            minor: std::sync::atomic::AtomicU32::new(33),
        });
        let shutdown = CancellationToken::new();
        let app = axum::Router::new().fallback(handle).with_state(shared.clone());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await;
        });
        let server = ApiServer { address, shared, shutdown, admin_token };
        server.seed();
        Ok(server)
    }

    /// What a fresh cluster has: the namespaces the node uses, each with
    /// its `default` service account.
    fn seed(&self) {
        let namespaces = store::resource("", "v1", "namespaces").expect("namespaces");
        let accounts = store::resource("", "v1", "serviceaccounts").expect("serviceaccounts");
        let mut store = self.shared.store();
        for name in ["default", "kube-system", "kube-node-lease"] {
            let _ = store.create(namespaces, "", json!({"metadata": {"name": name}, "status": {"phase": "Active"}}));
            let _ = store.create(accounts, name, json!({"metadata": {"name": "default", "namespace": name}}));
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The administrator's bearer token.
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// A bearer token for the node identity `system:node:<node>`.
    pub fn node_token(&self, node: &str) -> String {
        let token = format!("node-token-{node}");
        self.shared.tokens.lock().expect("lock").insert(token.clone(), Identity::Node(node.to_owned()));
        token
    }

    /// Writes a kubeconfig for `token` at `path`.
    pub fn write_kubeconfig(&self, path: &Path, token: &str) -> std::io::Result<()> {
        write_kubeconfig(path, &self.url(), token)
    }

    /// A bearer token for service account `<namespace>/<name>`, which
    /// SubjectAccessReviews allow `allowed` (verb, resource, subresource)
    /// and nothing else: Prometheus' `get nodes/metrics`, say.
    pub fn service_account_token(&self, namespace: &str, name: &str, allowed: &[(&str, &str, &str)]) -> String {
        let token = format!("sa-token-{namespace}-{name}");
        let allowed = allowed.iter().map(|(v, r, s)| ((*v).to_owned(), (*r).to_owned(), (*s).to_owned())).collect();
        let who = Identity::ServiceAccount { namespace: namespace.to_owned(), name: name.to_owned(), allowed };
        self.shared.tokens.lock().expect("lock").insert(token.clone(), who);
        token
    }

    /// A kube-rs client with `token`, configured from a kubeconfig file as
    /// a user would give one.
    pub async fn client(&self, token: &str) -> Result<kube::Client, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = dir.path().join("kubeconfig");
        self.write_kubeconfig(&path, token).map_err(|e| e.to_string())?;
        let kubeconfig = kube::config::Kubeconfig::read_from(&path).map_err(|e| e.to_string())?;
        let options = kube::config::KubeConfigOptions::default();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options).await.map_err(|e| e.to_string())?;
        kube::Client::try_from(config).map_err(|e| e.to_string())
    }

    /// Answers `/version` as Kubernetes `1.<minor>.0` from now on (33
    /// unless a test says otherwise).
    pub fn set_minor_version(&self, minor: u32) {
        self.shared.minor.store(minor, Ordering::Relaxed);
    }

    /// Serves only `versions` of `resource.k8s.io` from now on (a 1.33
    /// server with the betas turned on: `v1beta2` and `v1beta1`); the
    /// others answer 404 and are not in discovery.
    pub fn serve_resource_versions(&self, versions: &[ResourceVersion]) {
        *self.shared.resource_versions.lock().unwrap_or_else(|p| p.into_inner()) = versions.to_vec();
    }

    /// Adds a fault.
    pub fn inject(&self, fault: Fault) {
        self.shared.faults.lock().expect("lock").push(fault);
    }

    /// Removes every fault.
    pub fn clear_faults(&self) {
        self.shared.faults.lock().expect("lock").clear();
    }

    /// Ends every open watch (clients see the stream close).
    pub fn drop_watches(&self) {
        self.shared.drop_watches.send_modify(|g| *g += 1);
    }

    /// Forgets the history: a watch resumed from any current version gets
    /// 410, as after an etcd compaction.
    pub fn compact(&self) {
        self.shared.store().compact();
        self.drop_watches();
    }

    /// The requests received so far.
    pub fn requests(&self) -> Vec<Logged> {
        self.shared.log.lock().expect("lock").clone()
    }

    /// Waits (at most `timeout`) until the requests received so far
    /// satisfy `done`; returns them, or, on timeout, them as an error.
    pub async fn wait_requests(
        &self,
        timeout: Duration,
        mut done: impl FnMut(&[Logged]) -> bool,
    ) -> Result<Vec<Logged>, Vec<Logged>> {
        let mut logged = self.shared.logged.subscribe();
        let waited = tokio::time::timeout(timeout, async {
            loop {
                logged.borrow_and_update();
                let requests = self.requests();
                if done(&requests) {
                    return requests;
                }
                if logged.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        waited.map_err(|_| self.requests())
    }

    /// The object `name` of `plural` (in `group`; `namespace` "" when
    /// cluster-scoped), read directly.
    pub fn object(&self, group: &str, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        let resource = store::RESOURCES.iter().copied().find(|r| r.group == group && r.plural == plural)?;
        self.shared.store().get(&Key::new(resource, namespace, name)).cloned()
    }

    /// Waits until `pred` holds for the object (`None`: absent), up to
    /// `timeout`; returns what it last saw and whether it held.
    pub async fn wait_object(
        &self,
        (group, plural, namespace, name): (&str, &str, &str, &str),
        timeout: Duration,
        mut pred: impl FnMut(Option<&Value>) -> bool,
    ) -> Result<Option<Value>, Option<Value>> {
        let mut changes = self.shared.store().subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let seen = self.object(group, plural, namespace, name);
            if pred(seen.as_ref()) {
                return Ok(seen);
            }
            match tokio::time::timeout_at(deadline, changes.recv()).await {
                Err(_) => return Err(seen),
                Ok(Err(broadcast::error::RecvError::Closed)) => return Err(seen),
                Ok(_) => {}
            }
        }
    }

    /// Every change from now on, as watches see them.
    pub fn changes(&self) -> broadcast::Receiver<Change> {
        self.shared.store().subscribe()
    }
}

/// Decodes `%XX` escapes and `+`.
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%' && i + 2 < bytes.len())
            .then(|| std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()))
            .flatten();
        match (escaped, bytes[i]) {
            (Some(byte), _) => {
                out.push(byte);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, byte) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_map(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// What a path names.
struct Route {
    resource: Resource,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

/// The discovery document of a group version the server serves
/// (`/api/v1`, `/apis/<group>/<version>`): its resources.
fn discovery(shared: &Shared, path: &str) -> Option<Value> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version) = match parts.as_slice() {
        ["api", version] => ("", *version),
        ["apis", group, version] => (*group, *version),
        _ => return None,
    };
    let resources: Vec<Value> = store::RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version && shared.serves(r))
        .map(|r| {
            json!({"name": r.plural, "singularName": "", "namespaced": r.namespaced, "kind": r.kind,
                   "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]})
        })
        .collect();
    if resources.is_empty() {
        return None;
    }
    let group_version = if group.is_empty() { version.to_owned() } else { format!("{group}/{version}") };
    Some(json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}))
}

fn route(path: &str) -> Result<Route, ApiError> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let not_found =
        || ApiError::new(404, "NotFound", format!("the server could not find the requested resource ({path})"));
    let (group, version, rest) = match parts.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Err(not_found()),
    };
    let lookup = |plural: &str| store::resource(group, version, plural).ok_or_else(not_found);
    let (namespace, rest) = match rest {
        ["namespaces", ns, more @ ..] if !more.is_empty() => (Some((*ns).to_owned()), more),
        _ => (None, rest),
    };
    let (plural, name, sub) = match rest {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some((*name).to_owned()), None),
        [plural, name, sub] => (*plural, Some((*name).to_owned()), Some((*sub).to_owned())),
        _ => return Err(not_found()),
    };
    let resource = lookup(plural)?;
    if !resource.namespaced && namespace.is_some() {
        return Err(not_found());
    }
    if resource.namespaced && namespace.is_none() && name.is_some() {
        return Err(not_found());
    }
    Ok(Route { resource, namespace, name, subresource: sub })
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let received = std::time::Instant::now();
    let user = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|t| shared.tokens.lock().expect("lock").get(t).map(|identity| identity.user()));
    let response = answer(&shared, &method, &uri, &headers, &body).await;
    let logged_method = method.clone();
    let mut log = shared.log.lock().expect("lock");
    log.push(Logged {
        method: logged_method,
        uri: uri.path_and_query().map(ToString::to_string).unwrap_or_default(),
        status: response.status().as_u16(),
        received,
        body: (method == Method::PATCH).then(|| String::from_utf8_lossy(&body).into_owned()),
        user,
    });
    shared.logged.send_replace(log.len());
    drop(log);
    response
}

async fn answer(shared: &Arc<Shared>, method: &Method, uri: &Uri, headers: &HeaderMap, body: &Bytes) -> Response {
    let fault = {
        let mut faults = shared.faults.lock().expect("lock");
        let path = uri.path();
        let found = faults
            .iter_mut()
            .find(|f| f.times > 0 && f.method.as_ref().is_none_or(|m| m == method) && path.contains(&f.path_contains));
        found.map(|f| {
            f.times -= 1;
            (f.status, f.delay)
        })
    };
    if let Some((status, delay)) = fault {
        tokio::time::sleep(delay).await;
        if status != 0 {
            let reason = match status {
                429 => "TooManyRequests",
                500 => "InternalError",
                503 => "ServiceUnavailable",
                _ => "InternalError",
            };
            let mut response = status_response(&ApiError::new(status, reason, format!("injected fault {status}")));
            if status == 429 {
                response.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            }
            return response;
        }
    }
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    let identity = token.and_then(|t| shared.tokens.lock().expect("lock").get(&t).cloned());
    let Some(identity) = identity else {
        return status_response(&ApiError::new(401, "Unauthorized", "Unauthorized"));
    };
    match serve(shared, &identity, method, uri, headers, body).await {
        Ok(response) => response,
        Err(error) => status_response(&error),
    }
}

/// The API server's validation of volume mounts' `mountPropagation`:
/// `Bidirectional` for privileged containers only, and only the three
/// modes, in the real server's words.
fn validate_mount_propagation(pod: &Value) -> Result<(), ApiError> {
    let name = pod.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default();
    let mut errors = Vec::new();
    for list in ["initContainers", "containers"] {
        let containers = pod.pointer(&format!("/spec/{list}")).and_then(Value::as_array).cloned().unwrap_or_default();
        for (i, container) in containers.iter().enumerate() {
            let privileged = container.pointer("/securityContext/privileged").and_then(Value::as_bool) == Some(true);
            let mounts = container.get("volumeMounts").and_then(Value::as_array).cloned().unwrap_or_default();
            for mount in &mounts {
                // The real server names the list, not the entry.
                let field = format!("spec.{list}[{i}].volumeMounts.mountPropagation");
                match mount.get("mountPropagation").and_then(Value::as_str) {
                    None | Some("None" | "HostToContainer") => {}
                    Some("Bidirectional") if privileged => {}
                    Some("Bidirectional") => errors.push(format!(
                        "{field}: Forbidden: Bidirectional mount propagation is available only to privileged containers"
                    )),
                    Some(other) => errors.push(format!(
                        "{field}: Unsupported value: {other:?}: supported values: \"Bidirectional\", \"HostToContainer\", \"None\""
                    )),
                }
            }
        }
    }
    match errors.len() {
        0 => Ok(()),
        1 => Err(ApiError::new(422, "Invalid", format!("Pod \"{name}\" is invalid: {}", errors[0]))),
        _ => Err(ApiError::new(422, "Invalid", format!("Pod \"{name}\" is invalid: [{}]", errors.join(", ")))),
    }
}

/// The RuntimeClass admission plugin: a pod naming a RuntimeClass that
/// does not exist is refused, in the real server's words.
fn admit_runtime_class(store: &Store, pod: &Value) -> Result<(), ApiError> {
    let Some(class) = pod.pointer("/spec/runtimeClassName").and_then(Value::as_str) else { return Ok(()) };
    let classes = store::resource("node.k8s.io", "v1", "runtimeclasses").expect("served");
    if store.get(&Key::new(classes, "", class)).is_some() {
        return Ok(());
    }
    Err(ApiError::new(403, "Forbidden", format!("pod rejected: RuntimeClass \"{class}\" not found")))
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    if body.is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_slice(body).map_err(|e| ApiError::new(400, "BadRequest", format!("the body is not JSON: {e}")))
}

async fn serve(
    shared: &Arc<Shared>,
    identity: &Identity,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response, ApiError> {
    if *method == Method::GET && uri.path() == "/version" {
        let minor = shared.minor.load(Ordering::Relaxed);
        return Ok(object_response(
            StatusCode::OK,
            &json!({"major": "1", "minor": minor.to_string(), "gitVersion": format!("v1.{minor}.0"),
                    "gitCommit": "", "gitTreeState": "clean", "buildDate": "", "goVersion": "",
                    "compiler": "gc", "platform": "linux/amd64"}),
        ));
    }
    if *method == Method::GET
        && let Some(list) = discovery(shared, uri.path())
    {
        return Ok(object_response(StatusCode::OK, &list));
    }
    let route = route(uri.path())?;
    if !shared.serves(&route.resource) {
        return Err(ApiError::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({})", uri.path()),
        ));
    }
    let query = query_map(uri);
    // Objects are kept in one version; a `resource.k8s.io` beta is
    // converted from it on the way out and to it on the way in, as the
    // real server's conversion does.
    let wire = route.resource;
    let resource = store::storage(wire);
    let beta = ResourceVersion::parse(wire.version).filter(|_| wire.group == resource_api::GROUP && wire != resource);
    let out = |mut object: Value| {
        if let Some(version) = beta {
            if object.get("apiVersion").is_none() {
                object["apiVersion"] = resource.api_version().into();
                object["kind"] = resource.kind.into();
            }
            resource_api::from_hub(&mut object, version);
        }
        object
    };
    let namespace = route.namespace.clone().unwrap_or_default();
    let sub = route.subresource.as_deref();
    let fields = Selector::parse(query.get("fieldSelector").map(String::as_str).unwrap_or_default())?;
    let labels = Selector::parse(query.get("labelSelector").map(String::as_str).unwrap_or_default())?;
    let watching = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let verb = match (method.as_str(), route.name.is_some()) {
        ("GET", false) if watching => "watch",
        ("GET", false) => "list",
        ("GET", true) => "get",
        ("POST", _) => "create",
        ("PUT", true) => "update",
        ("PATCH", true) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => return Err(ApiError::new(405, "MethodNotAllowed", format!("{method} is not supported here"))),
    };
    let mut body_value = parse_body(body)?;
    if beta.is_some() && *method != Method::PATCH && body_value.get("apiVersion").is_some() {
        resource_api::to_hub(&mut body_value);
    }
    let selected_name = query
        .get("fieldSelector")
        .and_then(|f| f.split(',').find_map(|t| t.strip_prefix("metadata.name=")))
        .map(str::to_owned);
    let create_name = body_value.pointer("/metadata/name").and_then(Value::as_str).map(str::to_owned);
    let name_for_auth = match verb {
        "create" if route.name.is_none() => create_name.as_deref(),
        "list" | "watch" => selected_name.as_deref(),
        _ => route.name.as_deref(),
    };
    {
        let store = shared.store();
        let request = auth::Request {
            verb,
            resource,
            subresource: sub,
            namespace: &namespace,
            name: name_for_auth,
            body: matches!(verb, "create" | "update" | "patch").then_some(&body_value),
            field_selector: query.get("fieldSelector").map(String::as_str).unwrap_or_default(),
        };
        auth::authorize(identity, &request, &store)?;
    }
    let matches = |object: &Value| fields.matches_fields(object) && labels.matches_labels(object);
    match verb {
        "watch" => {
            let since = query.get("resourceVersion").and_then(|rv| rv.parse::<u64>().ok()).filter(|rv| *rv > 0);
            let timeout = query.get("timeoutSeconds").and_then(|t| t.parse::<u64>().ok()).map(Duration::from_secs);
            let (fields, labels) = (fields.clone(), labels.clone());
            let filter: Filter = Box::new(move |o| fields.matches_fields(o) && labels.matches_labels(o));
            Ok(watch_stream(shared, resource, beta, route.namespace.clone(), since, timeout, filter))
        }
        "list" => {
            let store = shared.store();
            let items: Vec<Value> =
                store.list(resource, route.namespace.as_deref()).into_iter().filter(|o| matches(o)).collect();
            Ok(object_response(
                StatusCode::OK,
                &out(json!({
                    "kind": format!("{}List", resource.kind), "apiVersion": resource.api_version(),
                    "metadata": {"resourceVersion": store.rv().to_string()}, "items": items,
                })),
            ))
        }
        "get" => {
            let key = Key::new(resource, &namespace, route.name.as_deref().unwrap_or_default());
            let store = shared.store();
            let object = store.get(&key).ok_or_else(|| ApiError::not_found(resource, &key.name))?;
            Ok(object_response(StatusCode::OK, &out(object.clone())))
        }
        "create" if sub == Some("token") && resource.plural == "serviceaccounts" => {
            let name = route.name.clone().unwrap_or_default();
            let key = Key::new(resource, &namespace, &name);
            if shared.store().get(&key).is_none() {
                return Err(ApiError::not_found(resource, &name));
            }
            let seconds = body_value.pointer("/spec/expirationSeconds").and_then(Value::as_i64).unwrap_or(3600);
            let expires = jiff::Timestamp::now()
                .checked_add(jiff::SignedDuration::from_secs(seconds))
                .unwrap_or_else(|_| jiff::Timestamp::now())
                .round(jiff::Unit::Second)
                .unwrap_or_else(|_| jiff::Timestamp::now());
            let audiences: Vec<String> = body_value
                .pointer("/spec/audiences")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
                .unwrap_or_default();
            let serial = shared.token_serial.fetch_add(1, Ordering::Relaxed);
            let token =
                format!("fake-token.{namespace}.{name}.{}.{}.{serial}", audiences.join("+"), expires.as_second());
            let mut answer = body_value.clone();
            if !answer.is_object() {
                answer = json!({});
            }
            answer["apiVersion"] = "authentication.k8s.io/v1".into();
            answer["kind"] = "TokenRequest".into();
            answer["status"] = json!({"token": token, "expirationTimestamp": expires.to_string()});
            Ok(object_response(StatusCode::CREATED, &answer))
        }
        // A TokenReview: the tokens this server knows are authenticated.
        "create" if resource.plural == "tokenreviews" => {
            let token = body_value.pointer("/spec/token").and_then(Value::as_str).unwrap_or_default();
            let known = shared.tokens.lock().expect("lock").get(token).cloned();
            let status = match known {
                Some(who) => json!({"authenticated": true, "user": {"username": who.user(), "groups": who.groups()}}),
                None => json!({"authenticated": false, "error": "invalid bearer token"}),
            };
            let mut answer = if body_value.is_object() { body_value.clone() } else { json!({}) };
            answer["apiVersion"] = "authentication.k8s.io/v1".into();
            answer["kind"] = "TokenReview".into();
            answer["status"] = status;
            Ok(object_response(StatusCode::CREATED, &answer))
        }
        // A SubjectAccessReview: the administrator (group system:masters)
        // may do anything; a service account what it was granted; no one
        // else anything here.
        "create" if resource.plural == "subjectaccessreviews" => {
            let masters = body_value
                .pointer("/spec/groups")
                .and_then(Value::as_array)
                .is_some_and(|groups| groups.iter().any(|g| g == "system:masters"));
            let user = body_value.pointer("/spec/user").and_then(Value::as_str).unwrap_or_default();
            let attribute =
                |name: &str| body_value.pointer(&format!("/spec/resourceAttributes/{name}")).and_then(Value::as_str);
            let asked = (
                attribute("verb").unwrap_or_default(),
                attribute("resource").unwrap_or_default(),
                attribute("subresource").unwrap_or_default(),
            );
            let granted = shared.tokens.lock().expect("lock").values().any(|who| match who {
                Identity::ServiceAccount { allowed, .. } => {
                    who.user() == user && allowed.iter().any(|(v, r, s)| (v.as_str(), r.as_str(), s.as_str()) == asked)
                }
                _ => false,
            });
            let status = if masters {
                json!({"allowed": true, "reason": "system:masters"})
            } else if granted {
                json!({"allowed": true, "reason": "granted to the service account"})
            } else {
                json!({"allowed": false, "reason": "no RBAC policy matched"})
            };
            let mut answer = if body_value.is_object() { body_value.clone() } else { json!({}) };
            answer["apiVersion"] = "authorization.k8s.io/v1".into();
            answer["kind"] = "SubjectAccessReview".into();
            answer["status"] = status;
            Ok(object_response(StatusCode::CREATED, &answer))
        }
        // The scheduler's bind: `pods/<name>/binding` sets `spec.nodeName`
        // of a pod not bound yet.
        "create" if sub == Some("binding") && resource.plural == "pods" => {
            let name = route.name.clone().unwrap_or_default();
            let key = Key::new(resource, &namespace, &name);
            let target = body_value.pointer("/target/name").and_then(Value::as_str).unwrap_or_default().to_owned();
            if target.is_empty() {
                return Err(ApiError::new(400, "BadRequest", "a binding needs target.name"));
            }
            let mut store = shared.store();
            let mut pod = store.get(&key).cloned().ok_or_else(|| ApiError::not_found(resource, &name))?;
            if let Some(bound) = pod.pointer("/spec/nodeName").and_then(Value::as_str).filter(|n| !n.is_empty()) {
                return Err(ApiError::new(
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on pods/binding \"{name}\": pod {name} is already assigned to node \"{bound}\""
                    ),
                ));
            }
            pod["spec"]["nodeName"] = Value::String(target);
            store.replace(resource, &key, pod, false)?;
            Ok(object_response(
                StatusCode::CREATED,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
            ))
        }
        "create" => {
            if route.name.is_some() {
                return Err(ApiError::new(405, "MethodNotAllowed", "POST to a named object"));
            }
            let body_ns = body_value.pointer("/metadata/namespace").and_then(Value::as_str);
            if resource.namespaced && body_ns.is_some_and(|ns| ns != namespace) {
                return Err(ApiError::new(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            if resource.namespaced && namespace.is_empty() {
                return Err(ApiError::new(404, "NotFound", "a namespaced object is created in its namespace's path"));
            }
            if resource.plural == "pods" {
                validate_mount_propagation(&body_value)?;
                admit_runtime_class(&shared.store(), &body_value)?;
            }
            let created = shared.store().create(resource, &namespace, body_value)?;
            Ok(object_response(StatusCode::CREATED, &out(created)))
        }
        "update" => {
            let key = Key::new(resource, &namespace, route.name.as_deref().unwrap_or_default());
            if resource.plural == "pods" && sub == Some("resize") {
                let mut store = shared.store();
                let current = store.get(&key).cloned().ok_or_else(|| ApiError::not_found(resource, &key.name))?;
                let mut resized = resize::admit(&current, &body_value)?;
                if let Some(rv) = body_value.pointer("/metadata/resourceVersion") {
                    resized["metadata"]["resourceVersion"] = rv.clone();
                }
                let written = store.replace(resource, &key, resized, false)?;
                return Ok(object_response(StatusCode::OK, &out(written)));
            }
            let written = shared.store().replace(resource, &key, body_value, sub == Some("status"))?;
            Ok(object_response(StatusCode::OK, &out(written)))
        }
        "patch" => {
            let key = Key::new(resource, &namespace, route.name.as_deref().unwrap_or_default());
            let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
            let mut store = shared.store();
            let current = store.get(&key).cloned().ok_or_else(|| ApiError::not_found(resource, &key.name))?;
            // A patch is written against the version asked for.
            let mut patched = out(current.clone());
            match content_type.split(';').next().unwrap_or_default().trim() {
                "application/merge-patch+json" => store::merge_patch(&mut patched, &body_value),
                "application/json-patch+json" => store::json_patch(&mut patched, &body_value)?,
                "application/strategic-merge-patch+json"
                    if matches!(resource.plural, "pods" | "nodes" | "persistentvolumeclaims") =>
                {
                    store::strategic_merge_patch(&mut patched, &body_value);
                }
                other => {
                    return Err(ApiError::new(
                        415,
                        "UnsupportedMediaType",
                        format!(
                            "the fake API server takes merge and JSON patches, and strategic merge patches of pods, nodes and claims, not {other:?}"
                        ),
                    ));
                }
            }
            // A UID the patch sets is a precondition, as upstream's.
            let (want, have) = (patched.pointer("/metadata/uid"), current.pointer("/metadata/uid"));
            if want != have {
                return Err(ApiError::new(
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on {} \"{}\": Precondition failed: UID in precondition: {}, UID in object meta: {}",
                        resource.plural,
                        key.name,
                        want.and_then(Value::as_str).unwrap_or_default(),
                        have.and_then(Value::as_str).unwrap_or_default()
                    ),
                ));
            }
            // A resourceVersion the patch sets is a precondition; otherwise
            // the patch applies to the current version.
            let wanted = body_value.pointer("/metadata/resourceVersion").and_then(Value::as_str);
            if wanted.is_none() {
                patched["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
            }
            if beta.is_some() {
                resource_api::to_hub(&mut patched);
            }
            if resource.plural == "pods" && sub == Some("resize") {
                let resource_version = patched["metadata"]["resourceVersion"].clone();
                patched = resize::admit(&current, &patched)?;
                patched["metadata"]["resourceVersion"] = resource_version;
            }
            let written = store.replace(resource, &key, patched, sub == Some("status"))?;
            Ok(object_response(StatusCode::OK, &out(written)))
        }
        "delete" => {
            let key = Key::new(resource, &namespace, route.name.as_deref().unwrap_or_default());
            let mut store = shared.store();
            let current = store.get(&key).cloned().ok_or_else(|| ApiError::not_found(resource, &key.name))?;
            let uid = current.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or_default();
            if let Some(want) = body_value.pointer("/preconditions/uid").and_then(Value::as_str)
                && want != uid
            {
                return Err(ApiError::new(
                    409,
                    "Conflict",
                    format!("Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"),
                ));
            }
            if let Some(want) = body_value.pointer("/preconditions/resourceVersion").and_then(Value::as_str)
                && Some(want.parse::<u64>().unwrap_or(0)) != rv_of(&current)
            {
                return Err(ApiError::new(
                    409,
                    "Conflict",
                    format!(
                        "Precondition failed: ResourceVersion in precondition: {want}, ResourceVersion in object meta: {}",
                        rv_of(&current).unwrap_or(0)
                    ),
                ));
            }
            let bound = current.pointer("/spec/nodeName").and_then(Value::as_str).is_some_and(|n| !n.is_empty());
            let default_grace =
                current.pointer("/spec/terminationGracePeriodSeconds").and_then(Value::as_i64).unwrap_or(30);
            let grace = body_value
                .get("gracePeriodSeconds")
                .and_then(Value::as_i64)
                .or_else(|| query.get("gracePeriodSeconds").and_then(|g| g.parse().ok()))
                .unwrap_or(default_grace);
            let finished = current
                .pointer("/status/phase")
                .and_then(Value::as_str)
                .is_some_and(|p| p == "Succeeded" || p == "Failed");
            let object = if resource.plural == "pods" && bound && grace > 0 && !finished {
                store.mark_deleting(resource, &key, grace)?
            } else {
                store.remove(resource, &key)?
            };
            Ok(object_response(StatusCode::OK, &out(object)))
        }
        "deletecollection" if resource.plural == "resourceslices" => {
            let field_selector = query.get("fieldSelector").cloned().unwrap_or_default();
            for term in field_selector.split(',').filter(|t| !t.is_empty()) {
                let label = term.split(['=', '!']).next().unwrap_or_default();
                if !matches!(label, "metadata.name" | "spec.nodeName" | "spec.driver") {
                    return Err(ApiError::new(
                        400,
                        "BadRequest",
                        format!("field label not supported for {}, Kind=ResourceSlice: {label}", wire.api_version()),
                    ));
                }
            }
            // The Node authorizer: a node deletes its own slices only.
            if let Identity::Node(node) = identity
                && !field_selector.split(',').any(|t| t == format!("spec.nodeName={node}"))
            {
                return Err(ApiError::new(
                    403,
                    "Forbidden",
                    format!(
                        "resourceslices is forbidden: User \"system:node:{node}\" cannot deletecollection resource \"resourceslices\" in API group \"resource.k8s.io\" at the cluster scope: can only delete ResourceSlices with fieldSelector spec.nodeName={node}"
                    ),
                ));
            }
            let mut store = shared.store();
            let doomed: Vec<Value> = store.list(resource, None).into_iter().filter(|o| matches(o)).collect();
            let mut removed = Vec::new();
            for object in doomed {
                let name = object.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_owned();
                removed.push(store.remove(resource, &Key::new(resource, "", &name))?);
            }
            Ok(object_response(
                StatusCode::OK,
                &out(json!({
                    "kind": "ResourceSliceList", "apiVersion": resource.api_version(),
                    "metadata": {"resourceVersion": store.rv().to_string()}, "items": removed,
                })),
            ))
        }
        _ => Err(ApiError::new(405, "MethodNotAllowed", format!("{verb} is not supported"))),
    }
}

type Filter = Box<dyn Fn(&Value) -> bool + Send + Sync>;

fn event(kind: &str, object: &Value) -> String {
    format!("{}\n", json!({"type": kind, "object": object}))
}

/// An event with its object in `version` of `resource.k8s.io` (as kept
/// when `None`).
fn event_in(kind: &str, object: &Value, version: Option<ResourceVersion>) -> String {
    match version {
        Some(version) => {
            let mut object = object.clone();
            resource_api::from_hub(&mut object, version);
            event(kind, &object)
        }
        None => event(kind, object),
    }
}

/// A watch: newline-separated JSON events until the client goes, the
/// timeout passes, or the server drops its watches.
fn watch_stream(
    shared: &Arc<Shared>,
    resource: Resource,
    version: Option<ResourceVersion>,
    namespace: Option<String>,
    since: Option<u64>,
    timeout: Option<Duration>,
    filter: Filter,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<String, std::io::Error>>(256);
    let in_scope = move |key: &Key| {
        key.group == resource.group
            && key.plural == resource.plural
            && namespace.as_deref().is_none_or(|ns| key.namespace == ns)
    };
    let (initial, mut changes, start) = {
        let store = shared.store();
        let changes = store.subscribe();
        let initial: Result<Vec<String>, ApiError> = match since {
            Some(rv) if rv < store.floor() => {
                Err(ApiError::new(410, "Expired", format!("too old resource version: {rv} ({})", store.floor())))
            }
            Some(rv) => Ok(store
                .since(rv)
                .into_iter()
                .filter(|c| in_scope(&c.key) && filter(&c.object))
                .map(|c| event_in(c.kind.wire(), &c.object, version))
                .collect()),
            None => {
                let mut all = Vec::new();
                for (key, object) in store_objects(&store, resource) {
                    if in_scope(&key) && filter(&object) {
                        all.push(event_in("ADDED", &object, version));
                    }
                }
                Ok(all)
            }
        };
        (initial, changes, store.rv())
    };
    let mut dropped = shared.drop_watches.subscribe();
    dropped.borrow_and_update();
    tokio::spawn(async move {
        let initial = match initial {
            Ok(initial) => initial,
            Err(error) => {
                let _ = tx.send(Ok(event("ERROR", &error.status()))).await;
                return;
            }
        };
        for line in initial {
            if tx.send(Ok(line)).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout.unwrap_or(Duration::from_secs(3600)));
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                change = changes.recv() => match change {
                    Ok(change) => {
                        if change.rv <= start || !in_scope(&change.key) {
                            continue;
                        }
                        let was_in = change.before.as_ref().is_some_and(&filter);
                        let line = match (change.kind, filter(&change.object)) {
                            // Entering or leaving a selection is an addition
                            // or a deletion for that watch, as upstream.
                            (EventType::Modified, true) if !was_in => event_in("ADDED", &change.object, version),
                            (EventType::Modified, false) if was_in => event_in("DELETED", &change.object, version),
                            (kind, true) => event_in(kind.wire(), &change.object, version),
                            (_, false) => continue,
                        };
                        if tx.send(Ok(line)).await.is_err() {
                            return;
                        }
                    }
                    // Too slow a reader: the watch ends, the client resumes.
                    Err(_) => return,
                },
                _ = dropped.changed() => return,
                () = &mut deadline => return,
                () = tx.closed() => return,
            }
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response()
}

fn store_objects(store: &Store, resource: Resource) -> Vec<(Key, Value)> {
    store
        .list(resource, None)
        .into_iter()
        .map(|object| {
            let namespace = object.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or_default();
            let name = object.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default();
            (Key::new(resource, namespace, name), object)
        })
        .collect()
}
