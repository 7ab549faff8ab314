//! gRPC over Unix sockets: dial a plugin, serve on a socket path.
//!
//! tonic speaks HTTP/2 over TCP by default; plugins use Unix sockets. The
//! client side is [`UdsChannel`]: one HTTP/2 connection over a `UnixStream`,
//! driven by hyper directly. A conversation with a plugin is a few calls on a
//! fresh connection, so tonic's `Channel` (a reconnecting, buffered service
//! with a worker task) would only add a task hop to every call. The server
//! side feeds a `UnixListener` as the incoming connection stream.

use std::future::Future;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use std::pin::Pin;
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;

use crate::authority::AuthorityFix;

/// Errors of dialing or serving on a Unix socket.
#[derive(Debug, thiserror::Error)]
pub enum UdsError {
    /// The connection was not established within the deadline.
    #[error("dial {path}: no connection within {timeout:?}")]
    DialTimeout {
        /// Socket path dialed.
        path: PathBuf,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// The socket refused or failed the connection.
    #[error("dial {path}: {reason}")]
    Dial {
        /// Socket path dialed.
        path: PathBuf,
        /// What the transport reported, with its causes.
        reason: String,
    },
    /// The socket could not be bound.
    #[error("bind {path}: {source}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// The process serving the socket is not trusted (see [`dial_checked`]).
    #[error("dial {path}: refused: {reason}")]
    Untrusted {
        /// Socket path dialed.
        path: PathBuf,
        /// Why the peer is not trusted.
        reason: String,
    },
    /// Something other than a socket already sits at the path.
    #[error("bind {path}: a non-socket file is in the way")]
    NotASocket {
        /// Socket path.
        path: PathBuf,
    },
}

/// Strips a `unix://` scheme if present: CSI endpoints are written either as
/// `unix:///path/csi.sock` or as a plain path.
pub fn socket_path_of(endpoint: &str) -> &Path {
    Path::new(endpoint.strip_prefix("unix://").unwrap_or(endpoint))
}

/// How long a refused connection is retried before it counts as a failure.
///
/// A server creates its socket file with `bind()` and accepts connections
/// only after `listen()`; a watcher that reacts to the file's creation can
/// connect in between and be refused. Retrying briefly (a few times at once,
/// then after 1, 2, 4 … ms) bridges that gap; a stale socket that nobody
/// serves costs this much per attempt.
pub(crate) const REFUSED_GRACE: Duration = Duration::from_millis(100);

/// A gRPC client connection to one Unix socket. Cheap to clone (clones share
/// the connection); the connection closes when the last clone is dropped.
/// Pass it to a generated client: `RegistrationClient::new(channel)`.
#[derive(Clone, Debug)]
pub struct UdsChannel {
    sender: hyper::client::conn::http2::SendRequest<tonic::body::Body>,
}

impl tower::Service<http::Request<tonic::body::Body>> for UdsChannel {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.sender.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        // Generated clients send the path only; HTTP/2 needs :scheme and
        // :authority. The authority is a placeholder, as for any Unix socket.
        let mut parts = std::mem::take(request.uri_mut()).into_parts();
        parts.scheme.get_or_insert(http::uri::Scheme::HTTP);
        parts.authority.get_or_insert(http::uri::Authority::from_static("localhost"));
        *request.uri_mut() = Uri::from_parts(parts).unwrap_or_default();
        Box::pin(self.sender.send_request(request))
    }
}

/// Who is at the other end of a Unix socket connection, as the kernel
/// recorded it (`SO_PEERCRED`: for a server, the credentials it had when it
/// called `listen`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCredentials {
    /// Its user ID.
    pub uid: u32,
    /// Its group ID.
    pub gid: u32,
    /// Its process ID, where the kernel gives one.
    pub pid: Option<i32>,
}

impl From<tokio::net::unix::UCred> for PeerCredentials {
    fn from(credentials: tokio::net::unix::UCred) -> Self {
        PeerCredentials { uid: credentials.uid(), gid: credentials.gid(), pid: credentials.pid() }
    }
}

/// [`dial`], refusing the connection unless `check` accepts the serving
/// process's credentials (read on the very connection that is used, so no
/// other process can take the socket's place in between).
pub async fn dial_checked(
    path: impl AsRef<Path>,
    timeout: Duration,
    check: impl FnOnce(PeerCredentials) -> Result<(), String> + Send + 'static,
) -> Result<UdsChannel, UdsError> {
    Ok(dial_inner(path.as_ref(), timeout, Some(Box::new(check))).await?.0)
}

/// Opens a gRPC connection to the Unix socket at `path`, failing if it is not
/// established within `timeout`. Refused connections are retried for
/// [`REFUSED_GRACE`] (bounded by `timeout`).
pub async fn dial(path: impl AsRef<Path>, timeout: Duration) -> Result<UdsChannel, UdsError> {
    Ok(dial_watched(path, timeout).await?.0)
}

/// [`dial`], with a receiver that completes when the connection ends (the
/// server closed it or went away, or every clone of the channel was
/// dropped): what a client that keeps a connection open watches to know it
/// is still connected, without polling.
pub async fn dial_watched(
    path: impl AsRef<Path>,
    timeout: Duration,
) -> Result<(UdsChannel, tokio::sync::oneshot::Receiver<()>), UdsError> {
    dial_inner(path.as_ref(), timeout, None).await
}

/// A check of the serving process's credentials.
type PeerCheck = Box<dyn FnOnce(PeerCredentials) -> Result<(), String> + Send>;

async fn dial_inner(
    path: &Path,
    timeout: Duration,
    check: Option<PeerCheck>,
) -> Result<(UdsChannel, tokio::sync::oneshot::Receiver<()>), UdsError> {
    let path = path.to_path_buf();
    let grace = REFUSED_GRACE.min(timeout);
    let connect = async {
        let stream = connect_unix(&path, grace)
            .await
            .map_err(|e| UdsError::Dial { path: path.clone(), reason: error_chain(&e) })?;
        if let Some(check) = check {
            let peer = stream.peer_cred().map_err(|e| UdsError::Untrusted {
                path: path.clone(),
                reason: format!("cannot read the peer's credentials: {e}"),
            })?;
            check(peer.into()).map_err(|reason| UdsError::Untrusted { path: path.clone(), reason })?;
        }
        hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| UdsError::Dial { path: path.clone(), reason: error_chain(&e) })
    };
    let (sender, connection) = match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(pair)) => pair,
        Ok(Err(error)) => return Err(error),
        Err(_) => return Err(UdsError::DialTimeout { path, timeout }),
    };
    // Drives the connection until every clone of the channel is dropped. A
    // connection error needs no report here: the calls on it fail with it.
    let (ended, end) = tokio::sync::oneshot::channel();
    // Not supervised: one connection's driver; it ends with the connection.
    tokio::spawn(async move {
        let _ = connection.await;
        let _ = ended.send(());
    });
    Ok((UdsChannel { sender }, end))
}

/// How long a refused connection is retried at once (after yielding to
/// other tasks) before the retries start to sleep: the gap between a
/// server's `bind()` and its `listen()` is microseconds unless its thread is
/// preempted in between, and a timer sleep is at least 1 ms.
const IMMEDIATE_RETRY_WINDOW: Duration = Duration::from_micros(250);

async fn connect_unix(path: &Path, grace: Duration) -> io::Result<UnixStream> {
    let started = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        match UnixStream::connect(path).await {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused && started.elapsed() + pause <= grace => {
                if started.elapsed() < IMMEDIATE_RETRY_WINDOW {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
            }
            other => return other,
        }
    }
}

/// An error and its causes, joined by `: ` (tonic's transport error alone
/// says only "transport error"); a cause the text already holds is not
/// repeated.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Binds a listening Unix socket at `path`, creating the parent directory and
/// replacing a stale socket left by an earlier run. Refuses to replace any
/// other kind of file.
pub fn bind(path: impl AsRef<Path>) -> Result<UnixListener, UdsError> {
    let path = path.as_ref();
    let bind_err = |source| UdsError::Bind { path: path.to_path_buf(), source };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(bind_err)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path).map_err(bind_err)?,
        Ok(_) => {
            return Err(UdsError::NotASocket { path: path.to_path_buf() });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    UnixListener::bind(path).map_err(bind_err)
}

/// [`bind`], with the socket file's mode set to `mode` before any client
/// can reach it: the socket is bound under a hidden temporary name in the
/// same directory, given its mode, then renamed into place. (A socket
/// bound in place would carry the process's umask until a `chmod`; a
/// client could connect in between.)
pub fn bind_with_mode(path: impl AsRef<Path>, mode: u32) -> Result<UnixListener, UdsError> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = path.as_ref();
    let bind_err = |source| UdsError::Bind { path: path.to_path_buf(), source };
    let name = path.file_name().ok_or_else(|| bind_err(io::Error::from(io::ErrorKind::InvalidInput)))?;
    let mut temp_name = std::ffi::OsString::from(".");
    temp_name.push(name);
    temp_name.push(format!(".{}.tmp", std::process::id()));
    let temp = path.with_file_name(temp_name);
    let listener = bind(&temp)?;
    let placed = std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(mode)).and_then(|()| {
        match std::fs::symlink_metadata(path) {
            Ok(meta) if !meta.file_type().is_socket() => {
                return Err(io::Error::new(io::ErrorKind::AlreadyExists, "a non-socket file is in the way"));
            }
            _ => {}
        }
        std::fs::rename(&temp, path)
    });
    if let Err(source) = placed {
        let _ = std::fs::remove_file(&temp);
        return Err(bind_err(source));
    }
    Ok(listener)
}

/// Serves `router` on `listener` until `shutdown` completes. Every
/// connection goes through [`AuthorityFix`], so clients that send the raw
/// socket path as `:authority` (older grpc-go) are served like any other.
pub async fn serve(
    router: tonic::transport::server::Router,
    listener: UnixListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let incoming = UnixListenerStream::new(listener).map(|accepted| accepted.map(AuthorityFix::new));
    router.serve_with_incoming_shutdown(incoming, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_socket_bound_with_a_mode_has_it_whatever_the_umask() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).expect("a stale socket"));
        let listener = bind_with_mode(&path, 0o600).expect("bind");
        let meta = std::fs::symlink_metadata(&path).expect("socket");
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 1, "no temporary name is left behind");
        let client = tokio::net::UnixStream::connect(&path);
        let (accepted, connected) = tokio::join!(listener.accept(), client);
        accepted.expect("accept");
        connected.expect("connect");
        std::fs::write(dir.path().join("f"), "x").expect("file");
        assert!(bind_with_mode(dir.path().join("f"), 0o600).is_err(), "a regular file is not replaced");
        assert_eq!(std::fs::read_to_string(dir.path().join("f")).expect("kept"), "x");
    }

    #[test]
    fn unix_scheme_is_stripped_from_endpoints() {
        assert_eq!(socket_path_of("unix:///csi/csi.sock"), Path::new("/csi/csi.sock"));
        assert_eq!(socket_path_of("/csi/csi.sock"), Path::new("/csi/csi.sock"));
    }

    #[tokio::test]
    async fn dialing_a_missing_socket_names_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("absent.sock");
        let err = dial(&path, Duration::from_secs(1)).await.expect_err("must fail");
        assert!(err.to_string().contains("absent.sock"), "{err}");
        assert!(err.to_string().contains("No such file or directory"), "{err}");
    }

    #[tokio::test]
    async fn a_stale_socket_is_refused_after_the_grace() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
        let started = std::time::Instant::now();
        let err = dial(&path, Duration::from_secs(5)).await.expect_err("nobody listens");
        assert!(err.to_string().contains("Connection refused"), "{err}");
        assert!(started.elapsed() >= REFUSED_GRACE / 2, "refusals are retried for a while first");
    }

    #[test]
    fn bind_refuses_to_replace_a_regular_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("plugin.sock");
        std::fs::write(&path, b"not a socket").expect("write");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let err = rt.block_on(async { bind(&path).map(|_| ()) }).expect_err("must refuse");
        assert!(err.to_string().contains("non-socket"), "{err}");
    }
}
