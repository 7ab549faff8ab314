//! Errors of the device manager.

use std::path::PathBuf;
use std::time::Duration;

use kubelet_api::uds::UdsError;

/// Errors that stop the device manager from starting.
#[derive(Debug, thiserror::Error)]
pub enum DeviceManagerError {
    /// The device-plugins directory could not be prepared.
    #[error("cannot prepare device plugin directory {path}: {source}")]
    Directory {
        /// The directory.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// `kubelet.sock` could not be bound.
    #[error(transparent)]
    Bind(#[from] UdsError),
    /// The directory could not be watched (to recreate `kubelet.sock`).
    #[error("cannot watch device plugin directory {path}: {source}")]
    Watch {
        /// The directory.
        path: PathBuf,
        /// What inotify reported.
        #[source]
        source: notify::Error,
    },
    /// The checkpoint writer thread could not be started.
    #[error("cannot start the device checkpoint writer thread: {source}")]
    Thread {
        /// The system error.
        #[source]
        source: std::io::Error,
    },
}

/// Why a device plugin could not be registered (told to the plugin, as the
/// gRPC status of `Register` or through the plugin watcher). The texts of
/// the first three are upstream's, so plugins log what they would log
/// against the kubelet.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    /// `RegisterRequest.version` is not `v1beta1`.
    #[error("requested API version {version:?} is not supported by kubelet. Supported version is [\"v1beta1\"]")]
    UnsupportedVersion {
        /// The version asked for.
        version: String,
    },
    /// The resource name is not an extended resource name.
    #[error("the ResourceName {0:?} is invalid")]
    InvalidResourceName(String),
    /// The endpoint is not a plain file name in the device-plugins directory.
    #[error(
        "endpoint {endpoint:?} for resource {resource} must be a socket file name in the device plugin directory, without '/' or '..'"
    )]
    InvalidEndpoint {
        /// Resource name.
        resource: String,
        /// The endpoint given.
        endpoint: String,
    },
    /// The registering process, or the socket it names, is not trusted
    /// ([`crate::plugin_trust::PluginTrust`]).
    #[error("device plugin registration for resource {resource} refused: {reason}")]
    Untrusted {
        /// Resource name.
        resource: String,
        /// Why.
        reason: String,
    },
    /// The plugin's socket could not be dialed.
    #[error("failed to dial device plugin for resource {resource}: {source}")]
    Dial {
        /// Resource name.
        resource: String,
        /// Transport error.
        #[source]
        source: UdsError,
    },
    /// A call to the plugin failed.
    #[error("device plugin for resource {resource}: {rpc} failed: {status}")]
    Rpc {
        /// Resource name.
        resource: String,
        /// The RPC.
        rpc: &'static str,
        /// The gRPC status.
        status: tonic::Status,
    },
    /// A call to the plugin did not answer in time.
    #[error("device plugin for resource {resource}: {rpc} did not answer within {timeout:?}")]
    Timeout {
        /// Resource name.
        resource: String,
        /// The RPC.
        rpc: &'static str,
        /// The deadline.
        timeout: Duration,
    },
    /// The device manager is shutting down.
    #[error("the device manager is shutting down")]
    ShuttingDown,
}
