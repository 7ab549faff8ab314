//! Container lifecycle hooks (`lifecycle.postStart`, `lifecycle.preStop`),
//! as the kubelet runs them:
//!
//! - **postStart** runs right after the container starts, before its probes
//!   count it as started; if it fails the container is stopped (event
//!   `FailedPostStartHook`) and its restart policy decides what follows.
//! - **preStop** runs before a running container is stopped, within the
//!   grace period; what it uses of the period is taken from the stop's
//!   (at least 2 s are left); a failure is an event (`FailedPreStopHook`)
//!   and the stop goes on.
//!
//! Handlers: `exec` (a command in the container, through the provider;
//! a non-zero exit fails), `httpGet` (a GET to `host`, by default the
//! pod's IP, at `port` and `path`; HTTPS without checking the certificate;
//! any answer succeeds, as upstream) and `sleep` (the API's newer handler:
//! waits its `seconds`, within the hook's time). As upstream, a hook's `host` may name
//! any address: the pod's author asks the node to call it.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, LifecycleHandler, Pod};

use crate::provider::{ContainerId, Provider};

/// Which hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hook {
    /// After the container starts.
    PostStart,
    /// Before the container is stopped.
    PreStop,
}

impl Hook {
    /// The event reason of a failure.
    pub(crate) fn failure_reason(self) -> &'static str {
        match self {
            Hook::PostStart => "FailedPostStartHook",
            Hook::PreStop => "FailedPreStopHook",
        }
    }

    /// The container's handler for this hook, if it has one.
    pub(crate) fn handler(self, container: &Container) -> Option<&LifecycleHandler> {
        let lifecycle = container.lifecycle.as_ref()?;
        match self {
            Hook::PostStart => lifecycle.post_start.as_ref(),
            Hook::PreStop => lifecycle.pre_stop.as_ref(),
        }
    }
}

/// The least of the grace period a preStop hook leaves the stop.
pub(crate) const MIN_STOP_GRACE: Duration = Duration::from_secs(2);

/// Runs `hook` of `container` (running as `id` in `pod`, whose address is
/// `address`) within `timeout`. `Ok` when it has no such hook or it
/// succeeded; else upstream's message.
pub(crate) async fn run(
    hook: Hook,
    provider: &Arc<dyn Provider>,
    pod: &Pod,
    container: &Container,
    id: &ContainerId,
    address: IpAddr,
    timeout: Duration,
) -> Result<(), String> {
    let Some(handler) = hook.handler(container) else { return Ok(()) };
    let pod_name = format!(
        "{}_{}({})",
        pod.metadata.name.as_deref().unwrap_or_default(),
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.uid.as_deref().unwrap_or_default()
    );
    let name = &container.name;
    if let Some(exec) = &handler.exec {
        let command = exec.command.clone().unwrap_or_default();
        let shown = format!("[{}]", command.join(" "));
        let failed = |error: String| {
            format!("Exec lifecycle hook ({shown}) for Container {name:?} in Pod {pod_name:?} failed - error: {error}")
        };
        if command.is_empty() {
            return Err(failed("the hook has no command".into()));
        }
        let call = provider.exec_sync(id, &command, timeout);
        return match tokio::time::timeout(timeout + Duration::from_secs(1), call).await {
            Err(_) => Err(failed(format!("command {shown} timed out after {timeout:?}"))),
            Ok(Err(error)) => Err(failed(error.to_string())),
            Ok(Ok(out)) if out.exit_code == 0 => Ok(()),
            Ok(Ok(out)) => {
                let mut output = out.stdout;
                output.extend_from_slice(&out.stderr);
                let output = String::from_utf8_lossy(&output).trim_end().to_owned();
                Err(format!(
                    "{}, message: {output:?}",
                    failed(format!("command '{}' exited with {}: {output}", command.join(" "), out.exit_code))
                ))
            }
        };
    }
    if let Some(get) = &handler.http_get {
        let path = get.path.clone().unwrap_or_default();
        let path = if path.starts_with('/') { path } else { format!("/{path}") };
        let failed = |error: String| {
            format!("HTTP lifecycle hook ({path}) for Container {name:?} in Pod {pod_name:?} failed - error: {error}")
        };
        let port = super::probe::port(&get.port, container).map_err(failed)?;
        let host = get.host.clone().filter(|h| !h.is_empty());
        let ip = match &host {
            None => address,
            Some(host) => resolve(host, port).await.map_err(failed)?,
        };
        let https = get.scheme.as_deref().is_some_and(|s| s.eq_ignore_ascii_case("HTTPS"));
        let addr = SocketAddr::new(ip, port);
        let host_header = match &host {
            Some(host) => format!("{host}:{port}"),
            None => addr.to_string(),
        };
        let headers: Vec<(String, String)> =
            get.http_headers.iter().flatten().map(|h| (h.name.clone(), h.value.clone())).collect();
        let call = super::probe::get_status(https, addr, host_header, &headers, &path);
        return match tokio::time::timeout(timeout, call).await {
            Err(_) => Err(failed(format!("no answer within {timeout:?}"))),
            Ok(Err(error)) => Err(failed(error)),
            Ok(Ok(status)) => {
                tracing::debug!(container = %name, %path, status, "HTTP lifecycle hook answered");
                Ok(())
            }
        };
    }
    if let Some(sleep) = &handler.sleep {
        let seconds = Duration::from_secs(u64::try_from(sleep.seconds).unwrap_or(0));
        // Cut short by the hook's time (a preStop's grace period), as upstream.
        tokio::time::sleep(seconds.min(timeout)).await;
        return Ok(());
    }
    if handler.tcp_socket.is_some() {
        // The API keeps tcpSocket for compatibility and the kubelet does
        // not run it either.
        return Err(format!("lifecycle hook for Container {name:?} in Pod {pod_name:?}: tcpSocket is not supported"));
    }
    Err(format!("lifecycle hook for Container {name:?} in Pod {pod_name:?} names no handler (exec or httpGet)"))
}

/// `host` as an address: an IP as is, a name looked up.
async fn resolve(host: &str, port: u16) -> Result<IpAddr, String> {
    if let Ok(ip) = host.trim_matches(['[', ']']).parse::<IpAddr>() {
        return Ok(ip);
    }
    let mut found = tokio::net::lookup_host((host, port)).await.map_err(|e| format!("lookup {host}: {e}"))?;
    found.next().map(|a| a.ip()).ok_or_else(|| format!("lookup {host}: no such host"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(lifecycle: serde_json::Value) -> Container {
        serde_json::from_value(serde_json::json!({"name": "c", "lifecycle": lifecycle})).expect("container")
    }

    #[tokio::test(start_paused = true)]
    async fn a_sleep_hook_waits_its_seconds_within_the_hooks_time() {
        let pod = Pod::default();
        let c = container(serde_json::json!({"preStop": {"sleep": {"seconds": 30}}}));
        let provider: Arc<dyn Provider> = Arc::new(crate::pod::idle_provider::IdleProvider);
        let id = ContainerId("x".into());
        let address = IpAddr::from([127, 0, 0, 1]);
        let began = tokio::time::Instant::now();
        run(Hook::PreStop, &provider, &pod, &c, &id, address, Duration::from_secs(60)).await.expect("slept");
        assert_eq!(began.elapsed().as_secs(), 30);
        let began = tokio::time::Instant::now();
        run(Hook::PreStop, &provider, &pod, &c, &id, address, Duration::from_secs(5)).await.expect("cut short");
        assert_eq!(began.elapsed().as_secs(), 5);
    }

    #[test]
    fn the_hook_picks_its_handler() {
        let c = container(serde_json::json!({"preStop": {"exec": {"command": ["true"]}}}));
        assert!(Hook::PreStop.handler(&c).is_some());
        assert!(Hook::PostStart.handler(&c).is_none());
        assert_eq!(Hook::PostStart.failure_reason(), "FailedPostStartHook");
    }

    #[tokio::test]
    async fn an_http_hook_reaches_its_host_and_a_refused_one_says_why() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut request = vec![0u8; 4096];
            let n = stream.read(&mut request).await.expect("read");
            stream.write_all(b"HTTP/1.1 500 Oops\r\ncontent-length: 0\r\n\r\n").await.expect("write");
            String::from_utf8_lossy(&request[..n]).into_owned()
        });
        let pod: Pod =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "p", "namespace": "n", "uid": "u"}}))
                .expect("pod");
        let c = container(serde_json::json!({"postStart": {"httpGet": {"path": "/echo?msg=poststart", "port": port}}}));
        let provider: Arc<dyn Provider> = Arc::new(crate::pod::idle_provider::IdleProvider);
        let id = ContainerId("x".into());
        let loopback = IpAddr::from([127, 0, 0, 1]);
        // Any answer counts, as upstream.
        run(Hook::PostStart, &provider, &pod, &c, &id, loopback, Duration::from_secs(30)).await.expect("hook");
        let request = server.await.expect("server");
        assert!(request.starts_with("GET /echo?msg=poststart HTTP/1.1"), "{request}");
        // Nothing listens any more.
        let error = run(Hook::PostStart, &provider, &pod, &c, &id, loopback, Duration::from_secs(30))
            .await
            .expect_err("refused");
        assert!(
            error.starts_with(
                "HTTP lifecycle hook (/echo?msg=poststart) for Container \"c\" in Pod \"p_n(u)\" failed - error: Get"
            ),
            "{error}"
        );
    }
}
