//! `/exec`, `/attach` and `/portForward`: the session is asked of the
//! pod's provider, and the client's upgraded connection (SPDY or
//! WebSocket, whichever it asked for) is joined to the runtime's streaming
//! server byte for byte, as the kubelet proxies it. Also `/runningpods/`.

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::ApiState;
use crate::provider::{ContainerId, ProviderError, ProviderErrorKind, StreamRequest, StreamSession, StreamingEndpoint};
use crate::state::{Sessions, SessionsFull};

/// The pod `namespace/name` (with `uid`, if given) among the node's pods.
/// How long the runtime's streaming server has to accept a connection and
/// to answer the upgrade.
const PROXY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// Why a request cannot be served: its status and message.
type Refused = (StatusCode, String);

/// A refusal as a `v1.Status`: what a client of an upgrade reads when the
/// upgrade does not happen (kubectl shows its reason and message; plain
/// text shaped like `key: value` would be misread as YAML).
fn refused((code, message): Refused) -> Response {
    let reason = match code {
        StatusCode::NOT_FOUND => "NotFound",
        StatusCode::BAD_REQUEST => "BadRequest",
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        _ => "InternalError",
    };
    let status = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    (code, Json(status)).into_response()
}

fn find_pod(state: &ApiState, namespace: &str, name: &str, uid: Option<&str>) -> Result<Pod, Refused> {
    state
        .http
        .views
        .pods
        .store()
        .list()
        .into_iter()
        .find(|p| {
            p.metadata.namespace.as_deref() == Some(namespace)
                && p.metadata.name.as_deref() == Some(name)
                && uid.is_none_or(|uid| p.metadata.uid.as_deref() == Some(uid))
        })
        .ok_or_else(|| (StatusCode::NOT_FOUND, format!("pod \"{name}\" not found in namespace \"{namespace}\"")))
}

/// The provider's id of the running container `container` of `pod`.
fn running_container(pod: &Pod, container: &str) -> Result<ContainerId, Refused> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let status = pod.status.as_ref().and_then(|s| {
        s.container_statuses
            .iter()
            .flatten()
            .chain(s.init_container_statuses.iter().flatten())
            .chain(s.ephemeral_container_statuses.iter().flatten())
            .find(|c| c.name == container)
    });
    let Some(status) = status else {
        return Err((StatusCode::NOT_FOUND, format!("container \"{container}\" not found in pod \"{name}\"")));
    };
    let running = status.state.as_ref().is_some_and(|s| s.running.is_some());
    match status.container_id.as_deref() {
        Some(id) if running => Ok(ContainerId(id.split_once("://").map_or(id, |(_, raw)| raw).to_owned())),
        _ => Err((StatusCode::BAD_REQUEST, format!("container \"{container}\" in pod \"{name}\" is not running"))),
    }
}

fn flag(value: &str) -> bool {
    matches!(value, "1" | "true" | "True")
}

/// The session's options, from the query as the API server sends them
/// (`command` repeated, `input`, `output`, `error`, `tty`).
fn stream_request(query: Option<&str>, exec: bool) -> Result<StreamRequest, String> {
    let mut request = StreamRequest::default();
    for pair in query.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value).ok_or_else(|| format!("{key}: bad percent-encoding"))?;
        match key {
            "command" => request.command.push(value),
            "input" | "stdin" => request.stdin = flag(&value),
            "output" | "stdout" => request.stdout = flag(&value),
            "error" | "stderr" => request.stderr = flag(&value),
            "tty" => request.tty = flag(&value),
            _ => {}
        }
    }
    if exec && request.command.is_empty() {
        return Err("you must specify a command".into());
    }
    if !(request.stdin || request.stdout || request.stderr) {
        return Err("you must specify at least 1 of stdin, stdout, stderr".into());
    }
    if request.tty {
        // A terminal merges stderr into stdout.
        request.stderr = false;
    }
    Ok(request)
}

/// Decodes `%XX` and `+` in a query value.
pub(crate) fn percent_decode(value: &str) -> Option<String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn provider_error(what: &str, error: &ProviderError) -> Response {
    let code = match error.kind {
        ProviderErrorKind::NotFound => StatusCode::NOT_FOUND,
        ProviderErrorKind::Unsupported => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    refused((code, format!("{what}: {}", error.message)))
}

#[derive(Clone, Copy)]
enum Session {
    Exec,
    Attach,
}

async fn session(
    state: ApiState,
    kind: Session,
    (namespace, pod, uid, container): (String, String, Option<String>, String),
    query: Option<String>,
    request: Request,
) -> Response {
    let options = match stream_request(query.as_deref(), matches!(kind, Session::Exec)) {
        Ok(options) => options,
        Err(error) => return refused((StatusCode::BAD_REQUEST, error)),
    };
    let pod = match find_pod(&state, &namespace, &pod, uid.as_deref()) {
        Ok(pod) => pod,
        Err(why) => return refused(why),
    };
    let id = match running_container(&pod, &container) {
        Ok(id) => id,
        Err(why) => return refused(why),
    };
    let Some(provider) = state.provider.as_ref() else {
        return refused((StatusCode::BAD_REQUEST, "this node runs no containers".into()));
    };
    let (what, endpoint) = match kind {
        Session::Exec => ("exec", provider.exec(&id, &options).await),
        Session::Attach => ("attach", provider.attach(&id, &options).await),
    };
    // (The query is the API server's: `input`, `output`, `error`, `tty`.)
    tracing::info!(%namespace, pod = %pod.metadata.name.as_deref().unwrap_or_default(), %container, session = what, command = ?options.command, "streaming session");
    match endpoint {
        Ok(StreamingEndpoint::Url(url)) => proxy(request, &url, &state.http.sessions).await,
        Ok(StreamingEndpoint::Session(session)) => serve_session(request, session, options, &state.http.sessions),
        Err(error) => provider_error(what, &error),
    }
}

/// Answers the client's upgrade and serves the provider's session on the
/// connection (SPDY/3.1; the remote-command protocol negotiated as the
/// kubelet does).
fn serve_session(
    mut request: Request,
    session: Box<dyn StreamSession>,
    options: StreamRequest,
    sessions: &Sessions,
) -> Response {
    let header_has = |name: header::HeaderName, needle: &str| {
        request
            .headers()
            .get_all(name)
            .iter()
            .any(|v| v.to_str().is_ok_and(|v| v.to_ascii_lowercase().contains(needle)))
    };
    if header_has(header::UPGRADE, "websocket") {
        return serve_websocket(request, session, options, sessions);
    }
    if !header_has(header::CONNECTION, "upgrade") || !header_has(header::UPGRADE, "spdy/3.1") {
        return refused((StatusCode::BAD_REQUEST, "unable to upgrade: missing upgrade headers in request".into()));
    }
    let offered: Vec<String> = request
        .headers()
        .get_all("x-stream-protocol-version")
        .iter()
        .filter_map(|v| v.to_str().ok().map(str::to_owned))
        .collect();
    if offered.is_empty() {
        return refused((StatusCode::BAD_REQUEST, "unable to upgrade: X-Stream-Protocol-Version is required".into()));
    }
    let Some(protocol) = super::spdy::negotiate(offered.iter().map(String::as_str)) else {
        let mut response = refused((
            StatusCode::FORBIDDEN,
            format!(
                "unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server accepts {:?}",
                super::spdy::PROTOCOLS
            ),
        ));
        for protocol in super::spdy::PROTOCOLS {
            response.headers_mut().append("x-accepted-stream-protocol-versions", HeaderValue::from_static(protocol));
        }
        return response;
    };
    let serve = move |io| super::spdy::serve(io, protocol, options, session);
    let mut response = match upgrade_to(&mut request, sessions, "SPDY/3.1", serve) {
        Ok(response) => response,
        Err(full) => return full.into_response(),
    };
    response.headers_mut().insert("x-stream-protocol-version", HeaderValue::from_static(protocol));
    response
}

/// Takes a streaming session's place (429 when every one is taken),
/// answers 101 switching to `upgrade`, and serves the upgraded connection
/// with `serve` as a session of the node.
fn upgrade_to<Fut>(
    request: &mut Request,
    sessions: &Sessions,
    upgrade: &'static str,
    serve: impl FnOnce(TokioIo<hyper::upgrade::Upgraded>) -> Fut + Send + 'static,
) -> Result<Response, SessionsFull>
where
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let guard = sessions.begin()?;
    let upgrading = hyper::upgrade::on(request);
    sessions.spawn(guard, async move {
        match upgrading.await {
            Ok(upgraded) => serve(TokioIo::new(upgraded)).await,
            Err(error) => tracing::debug!(%error, "the client did not upgrade"),
        }
    });
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static(upgrade));
    Ok(response)
}

pub(super) async fn exec(
    State(state): State<ApiState>,
    Path((namespace, pod, container)): Path<(String, String, String)>,
    RawQuery(query): RawQuery,
    request: Request,
) -> Response {
    session(state, Session::Exec, (namespace, pod, None, container), query, request).await
}

pub(super) async fn exec_uid(
    State(state): State<ApiState>,
    Path((namespace, pod, uid, container)): Path<(String, String, String, String)>,
    RawQuery(query): RawQuery,
    request: Request,
) -> Response {
    session(state, Session::Exec, (namespace, pod, Some(uid), container), query, request).await
}

pub(super) async fn attach(
    State(state): State<ApiState>,
    Path((namespace, pod, container)): Path<(String, String, String)>,
    RawQuery(query): RawQuery,
    request: Request,
) -> Response {
    session(state, Session::Attach, (namespace, pod, None, container), query, request).await
}

pub(super) async fn attach_uid(
    State(state): State<ApiState>,
    Path((namespace, pod, uid, container)): Path<(String, String, String, String)>,
    RawQuery(query): RawQuery,
    request: Request,
) -> Response {
    session(state, Session::Attach, (namespace, pod, Some(uid), container), query, request).await
}

async fn forward(state: ApiState, namespace: String, name: String, uid: Option<String>, request: Request) -> Response {
    let pod = match find_pod(&state, &namespace, &name, uid.as_deref()) {
        Ok(pod) => pod,
        Err(why) => return refused(why),
    };
    let Some(provider) = state.provider.as_ref() else {
        return refused((StatusCode::BAD_REQUEST, "this node runs no containers".into()));
    };
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    tracing::info!(%namespace, pod = %name, "port-forward session");
    // The ports come in the session's streams (SPDY); the runtime reads them there.
    match provider.port_forward(&uid, &[]).await {
        Ok(StreamingEndpoint::Url(url)) => proxy(request, &url, &state.http.sessions).await,
        Ok(StreamingEndpoint::Session(_)) => {
            refused((StatusCode::BAD_REQUEST, "port-forward: the provider offered no port-forward server".into()))
        }
        Err(error) => provider_error("port-forward", &error),
    }
}

pub(super) async fn port_forward(
    State(state): State<ApiState>,
    Path((namespace, pod)): Path<(String, String)>,
    request: Request,
) -> Response {
    forward(state, namespace, pod, None, request).await
}

pub(super) async fn port_forward_uid(
    State(state): State<ApiState>,
    Path((namespace, pod, uid)): Path<(String, String, String)>,
    request: Request,
) -> Response {
    forward(state, namespace, pod, Some(uid), request).await
}

/// Sends the client's request to the runtime's streaming server `url` and
/// joins the two upgraded connections; an answer that is not an upgrade
/// is passed back as it is.
async fn proxy(mut request: Request, url: &str, sessions: &Sessions) -> Response {
    let bad_gateway = |why: String| refused((StatusCode::BAD_GATEWAY, why));
    let uri: http::Uri = match url.parse() {
        Ok(uri) => uri,
        Err(error) => return bad_gateway(format!("the runtime's streaming URL {url:?} is not a URL: {error}")),
    };
    if uri.scheme_str() != Some("http") {
        return bad_gateway(format!(
            "the runtime's streaming URL {url:?} is not http:// (TLS streaming is not supported)"
        ));
    }
    let (Some(host), Some(authority)) = (uri.host(), uri.authority().cloned()) else {
        return bad_gateway(format!("the runtime's streaming URL {url:?} has no host"));
    };
    let port = uri.port_u16().unwrap_or(80);
    let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    let stream = match tokio::net::TcpStream::connect((host.as_str(), port)).await {
        Ok(stream) => stream,
        Err(error) => {
            return bad_gateway(format!("cannot reach the runtime's streaming server at {authority}: {error}"));
        }
    };
    let (mut sender, connection) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
        Ok(pair) => pair,
        Err(error) => return bad_gateway(format!("the runtime's streaming server: {error}")),
    };
    // Not supervised: one proxied connection.
    tokio::spawn(async move {
        if let Err(error) = connection.with_upgrades().await {
            tracing::debug!(%error, "streaming server connection ended");
        }
    });
    let client_upgrade = hyper::upgrade::on(&mut request);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut forwarded = http::Request::builder().method(request.method()).uri(path);
    for (name, value) in request.headers() {
        if name != header::HOST && name != header::AUTHORIZATION && name != header::CONTENT_LENGTH {
            forwarded = forwarded.header(name, value);
        }
    }
    forwarded = forwarded.header(
        header::HOST,
        HeaderValue::from_str(authority.as_str()).unwrap_or(HeaderValue::from_static("localhost")),
    );
    let forwarded = match forwarded.body(Body::empty()) {
        Ok(forwarded) => forwarded,
        Err(error) => return bad_gateway(format!("cannot build the request: {error}")),
    };
    let mut answer = match tokio::time::timeout(PROXY_DEADLINE, sender.send_request(forwarded)).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(error)) => return bad_gateway(format!("the runtime's streaming server: {error}")),
        Err(_) => return bad_gateway("the runtime's streaming server did not answer the upgrade".into()),
    };
    if answer.status() != StatusCode::SWITCHING_PROTOCOLS {
        let (parts, body) = answer.into_parts();
        return Response::from_parts(parts, Body::new(body));
    }
    let guard = match sessions.begin() {
        Ok(guard) => guard,
        Err(refused) => return refused.into_response(),
    };
    let backend_upgrade = hyper::upgrade::on(&mut answer);
    sessions.spawn(guard, async move {
        let (client, backend) = match tokio::join!(client_upgrade, backend_upgrade) {
            (Ok(client), Ok(backend)) => (client, backend),
            (client, backend) => {
                tracing::debug!(client = ?client.err(), backend = ?backend.err(), "a side of the session did not upgrade");
                return;
            }
        };
        let (mut client, mut backend) = (TokioIo::new(client), TokioIo::new(backend));
        match tokio::io::copy_bidirectional(&mut client, &mut backend).await {
            Ok((sent, received)) => tracing::debug!(sent, received, "streaming session ended"),
            Err(error) => tracing::debug!(%error, "streaming session ended with an error"),
        }
    });
    let mut response = Response::builder().status(StatusCode::SWITCHING_PROTOCOLS);
    for (name, value) in answer.headers() {
        response = response.header(name, value);
    }
    response.body(Body::empty()).unwrap_or_else(|_| bad_gateway("cannot answer the upgrade".into()))
}

/// A WebSocket session (`v5.channel.k8s.io`, `v4.channel.k8s.io`).
fn serve_websocket(
    mut request: Request,
    session: Box<dyn StreamSession>,
    options: StreamRequest,
    sessions: &Sessions,
) -> Response {
    let key = request.headers().get("sec-websocket-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let Some(key) = key else {
        return refused((StatusCode::BAD_REQUEST, "unable to upgrade: Sec-WebSocket-Key is required".into()));
    };
    let offered: Vec<String> = request
        .headers()
        .get_all("sec-websocket-protocol")
        .iter()
        .filter_map(|v| v.to_str().ok().map(str::to_owned))
        .collect();
    let Some(protocol) = super::websocket::negotiate(offered.iter().map(String::as_str)) else {
        // kubectl 1.30+ falls back to SPDY on any answer but 101.
        return refused((
            StatusCode::BAD_REQUEST,
            format!(
                "unable to upgrade: no WebSocket protocol in common: client supports {offered:?}, server accepts {:?}",
                super::websocket::PROTOCOLS
            ),
        ));
    };
    let serve = move |io| super::websocket::serve(io, protocol, options, session);
    let mut response = match upgrade_to(&mut request, sessions, "websocket", serve) {
        Ok(response) => response,
        Err(full) => return full.into_response(),
    };
    let headers = response.headers_mut();
    headers.insert("sec-websocket-protocol", HeaderValue::from_static(protocol));
    if let Ok(accept) = HeaderValue::from_str(&super::websocket::accept_key(&key)) {
        headers.insert("sec-websocket-accept", accept);
    }
    response
}

/// `GET /runningpods/`: the pods with a running container, as the runtime
/// sees them (name, namespace, uid; the running containers' names and
/// images).
pub(super) async fn running_pods(State(state): State<ApiState>) -> Response {
    let items: Vec<serde_json::Value> = state
        .http
        .views
        .pods
        .store()
        .list()
        .into_iter()
        .filter_map(|pod| {
            let running: Vec<serde_json::Value> = pod
                .status
                .as_ref()?
                .container_statuses
                .iter()
                .flatten()
                .filter(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
                .map(|c| json!({"name": c.name, "image": c.image}))
                .collect();
            (!running.is_empty()).then(|| {
                json!({
                    "metadata": {"name": pod.metadata.name, "namespace": pod.metadata.namespace, "uid": pod.metadata.uid, "creationTimestamp": null},
                    "spec": {"containers": running},
                    "status": {},
                })
            })
        })
        .collect();
    Json(json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_the_api_server_sends_is_read() {
        let request = stream_request(Some("command=sh&command=-c&command=echo+hi%21&input=1&output=1&error=1"), true)
            .expect("valid");
        assert_eq!(request.command, ["sh", "-c", "echo hi!"]);
        assert!(request.stdin && request.stdout && request.stderr && !request.tty);
        let request = stream_request(Some("command=sh&output=1&error=1&tty=1"), true).expect("valid");
        assert!(request.tty && !request.stderr, "a terminal has no separate stderr");
        assert_eq!(stream_request(Some("output=1"), true), Err("you must specify a command".into()));
        assert_eq!(
            stream_request(Some("command=ls"), true),
            Err("you must specify at least 1 of stdin, stdout, stderr".into())
        );
        assert!(stream_request(Some("output=1"), false).is_ok(), "attach needs no command");
        assert!(stream_request(Some("command=%zz&output=1"), true).is_err());
    }

    /// Fuzz target: exec/attach query strings (percent-encoded commands,
    /// flags): a request or a reason, never a panic.
    #[test]
    fn fuzz_stream_queries() {
        let ran = crate::fuzz::Fuzz::new("kubelet-api-requests").run(|input| {
            let text = String::from_utf8_lossy(input);
            let query = text.split_once('?').map_or(text.as_ref(), |(_, q)| q).trim_end();
            for exec in [true, false] {
                let _ = stream_request(Some(query), exec);
            }
            let _ = percent_decode(query);
        });
        assert!(ran > 3);
    }
}
