//! `kubelet.sock`: the node's side of device-plugin registration
//! (`v1beta1.Registration/Register`).
//!
//! Plugins watch `kubelet.sock` and register again when it is recreated (that
//! is how they learn the node restarted), so the server recreates it whenever
//! it is removed or replaced under us.
//!
//! A rebind that fails (something else sits at the path, the directory is
//! gone or full) is retried with backoff, 100 ms doubling to 30 s, and at
//! once when the path changes; meanwhile the server reports itself failing
//! (with the error and the next delay) through its health check, and healthy
//! again once it serves.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use kubelet_api::constants::{DEVICE_PLUGIN_VERSION, KUBELET_SOCKET};
use kubelet_api::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
use kubelet_api::deviceplugin::v1beta1::{Empty, RegisterRequest};
use notify::{RecursiveMode, Watcher as _};
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::DeviceManager;
use super::error::{DeviceManagerError, RegisterError};
use super::resource_name::is_extended_resource_name;
use crate::health::HealthReporter;

/// The first delay before binding `kubelet.sock` again after a failure.
const FIRST_RETRY: Duration = Duration::from_millis(100);
/// The longest delay between bind attempts.
const MAX_RETRY: Duration = Duration::from_secs(30);

/// Creates the directory (0750) and removes stale sockets in it; other files
/// (the checkpoint) are kept.
pub(super) fn prepare_dir(dir: &Path) -> Result<(), DeviceManagerError> {
    let err = |source| DeviceManagerError::Directory { path: dir.to_path_buf(), source };
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(err)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).map_err(err)?;
    }
    for entry in std::fs::read_dir(dir).map_err(err)? {
        let entry = entry.map_err(err)?;
        if entry.file_type().map_err(err)?.is_socket() {
            tracing::debug!(socket = %entry.path().display(), "removing stale device plugin socket");
            std::fs::remove_file(entry.path()).map_err(err)?;
        }
    }
    Ok(())
}

/// Serves the registration service, rebinding `kubelet.sock` when it goes.
pub(super) fn start(manager: DeviceManager) -> Result<(), DeviceManagerError> {
    let dir = manager.inner.config.plugin_dir.clone();
    let socket = dir.join(KUBELET_SOCKET);
    let (tx, mut changes) = mpsc::unbounded_channel();
    let watched = socket.clone();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let relevant = match res {
            Ok(event) => event.need_rescan() || event.paths.iter().any(|p| p == &watched),
            Err(_) => true,
        };
        if relevant {
            let _ = tx.send(());
        }
    })
    .map_err(|source| DeviceManagerError::Watch { path: dir.clone(), source })?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(|source| DeviceManagerError::Watch { path: dir.clone(), source })?;
    let mut listener = kubelet_api::uds::bind_with_mode(&socket, KUBELET_SOCK_MODE)?;
    // Taken now, not in the task: the socket may be gone before it runs.
    let mut identity = socket_identity(&socket);
    let shutdown = manager.inner.shutdown.clone();
    let tasks = manager.inner.tasks.clone();
    let health = manager.inner.registration_health.clone();
    let span = tracing::info_span!("device_plugin_registration", socket = %socket.display());
    // Not supervised (unfinished): the device manager's own `kubelet.sock` loop, which rebinds the socket and reports in its registration check; the manager is not given the node's supervisor.
    tasks.spawn(
        async move {
            let _watcher = watcher;
            loop {
                tracing::info!("serving device plugin registration");
                health.healthy();
                let stop = shutdown.child_token();
                let router = tonic::transport::Server::builder()
                    .add_service(RegistrationServer::new(RegistrationService { manager: manager.clone() }));
                // Not supervised: served until the loop around it stops it, and awaited there.
                let server = tokio::spawn(kubelet_api::uds::serve(router, listener, stop.clone().cancelled_owned()));
                // Wait until the socket is no longer ours, or shutdown.
                loop {
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        change = changes.recv() => {
                            let current = socket_identity(&socket);
                            if change.is_none() || current.is_none() || current != identity {
                                break;
                            }
                        }
                    }
                }
                stop.cancel();
                if let Ok(Err(error)) = server.await {
                    tracing::warn!(%error, "device plugin registration server stopped with an error");
                }
                if shutdown.is_cancelled() {
                    break;
                }
                tracing::warn!("kubelet.sock was removed or replaced; recreating it so plugins register again");
                let Some(bound) = rebind(&socket, &health, &mut changes, &shutdown).await else { break };
                listener = bound;
                identity = socket_identity(&socket);
                manager.inner.server_generation.send_modify(|g| *g += 1);
            }
        }
        .instrument(span),
    );
    Ok(())
}

/// Binds `socket` again, retrying with backoff (and at once when the path
/// changes) until it works; `None` on shutdown. While it fails, `health`
/// says why and when the next attempt is.
async fn rebind(
    socket: &Path,
    health: &HealthReporter,
    changes: &mut mpsc::UnboundedReceiver<()>,
    shutdown: &CancellationToken,
) -> Option<UnixListener> {
    let mut backoff = crate::retry::RetryBackoff::new(FIRST_RETRY, MAX_RETRY);
    loop {
        let error = match kubelet_api::uds::bind_with_mode(socket, KUBELET_SOCK_MODE) {
            Ok(listener) => return Some(listener),
            Err(error) => error,
        };
        let delay = backoff.next_delay();
        tracing::error!(%error, retry_in = ?delay, "cannot recreate kubelet.sock; device plugins cannot register until it is back");
        health.failing(format!("cannot serve device plugin registration: {error}; retrying in {delay:?}"));
        tokio::select! {
            () = shutdown.cancelled() => return None,
            () = tokio::time::sleep(delay) => {}
            // Something changed at the path (what was in the way may be gone).
            Some(()) = changes.recv() => {}
        }
    }
}

/// `kubelet.sock`'s mode: its owner (the node's user) and group (the
/// node's group) may connect; no one else. Device plugins run as root, or
/// as a user in the node's group named in `--plugin-allowed-uids`.
pub(super) const KUBELET_SOCK_MODE: u32 = 0o660;

fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path).ok().filter(|m| m.file_type().is_socket()).map(|m| (m.dev(), m.ino()))
}

/// `RegisterRequest.endpoint` must name a file in the directory itself.
fn endpoint_path(dir: &Path, resource: &str, endpoint: &str) -> Result<PathBuf, RegisterError> {
    let mut components = Path::new(endpoint).components();
    match (components.next(), components.next()) {
        (Some(Component::Normal(name)), None) => Ok(dir.join(name)),
        _ => Err(RegisterError::InvalidEndpoint { resource: resource.to_owned(), endpoint: endpoint.to_owned() }),
    }
}

struct RegistrationService {
    manager: DeviceManager,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let peer = request
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|info| info.peer_cred)
            .map(kubelet_api::uds::PeerCredentials::from);
        let request = request.into_inner();
        let resource = request.resource_name.clone();
        // Counted as it arrives, before validation, as upstream does.
        self.manager.inner.metrics.registration(&resource);
        let span = tracing::info_span!("register_device_plugin", resource = %resource, endpoint = %request.endpoint);
        async {
            let result = self.validate_and_connect(request, peer).await;
            if let Err(error) = &result {
                tracing::warn!(%error, "device plugin registration refused");
            }
            result.map(|()| Response::new(Empty {})).map_err(|e| {
                let message = e.to_string();
                match e {
                    RegisterError::UnsupportedVersion { .. }
                    | RegisterError::InvalidResourceName(_)
                    | RegisterError::InvalidEndpoint { .. } => Status::invalid_argument(message),
                    RegisterError::Timeout { .. } => Status::deadline_exceeded(message),
                    RegisterError::ShuttingDown => Status::unavailable(message),
                    RegisterError::Dial { .. } | RegisterError::Rpc { .. } => Status::unknown(message),
                    RegisterError::Untrusted { .. } => Status::permission_denied(message),
                }
            })
        }
        .instrument(span)
        .await
    }
}

impl RegistrationService {
    async fn validate_and_connect(
        &self,
        request: RegisterRequest,
        peer: Option<kubelet_api::uds::PeerCredentials>,
    ) -> Result<(), RegisterError> {
        let untrusted = |reason| RegisterError::Untrusted { resource: request.resource_name.clone(), reason };
        let trust = &self.manager.inner.config.trust;
        let peer = peer.ok_or_else(|| untrusted("the registering process's credentials cannot be read".into()))?;
        trust.check_peer(peer).map_err(|e| untrusted(e.to_string()))?;
        if request.version != DEVICE_PLUGIN_VERSION {
            return Err(RegisterError::UnsupportedVersion { version: request.version });
        }
        if !is_extended_resource_name(&request.resource_name) {
            return Err(RegisterError::InvalidResourceName(request.resource_name));
        }
        let socket = endpoint_path(&self.manager.inner.config.plugin_dir, &request.resource_name, &request.endpoint)?;
        trust
            .check_socket(&socket, peer)
            .map_err(|reason| untrusted(format!("endpoint {}: {reason}", request.endpoint)))?;
        self.manager.connect(&request.resource_name, &socket).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_must_stay_in_the_directory() {
        let dir = Path::new("/r/device-plugins");
        assert_eq!(endpoint_path(dir, "v.com/x", "gpu.sock").expect("plain name"), dir.join("gpu.sock"));
        for bad in ["../gpu.sock", "sub/gpu.sock", "/abs/gpu.sock", "..", ".", ""] {
            let err = endpoint_path(dir, "v.com/x", bad).expect_err(bad);
            assert!(err.to_string().contains("must be a socket file name"), "{bad}: {err}");
        }
    }

    #[test]
    fn bind_retries_back_off_from_100_ms_doubling_to_30_s() {
        let mut backoff = crate::retry::RetryBackoff::new(FIRST_RETRY, MAX_RETRY);
        let bases = [100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000, 30000];
        for base in bases {
            let delay = backoff.next_delay().as_millis() as u64;
            assert!((base..base * 2).contains(&delay), "{delay} ms for a base of {base} ms (plus jitter)");
        }
    }

    #[test]
    fn stale_sockets_are_removed_and_other_files_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let stale = dir.path().join("old-plugin.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
        let checkpoint = dir.path().join("kubelet_internal_checkpoint");
        std::fs::write(&checkpoint, b"{}").expect("write");
        prepare_dir(dir.path()).expect("prepare");
        assert!(!stale.exists());
        assert!(checkpoint.exists());
        let fresh = dir.path().join("new/device-plugins");
        prepare_dir(&fresh).expect("create");
        assert_eq!(std::fs::metadata(&fresh).expect("meta").permissions().mode() & 0o777, 0o750);
    }
}
