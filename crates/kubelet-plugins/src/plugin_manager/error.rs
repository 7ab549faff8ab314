//! Errors of the plugin registration service.

use std::path::PathBuf;
use std::time::Duration;

use kubelet_api::uds::UdsError;

use super::handler::{HandlerError, PluginType};
use super::watcher::WatcherError;

/// Errors that stop the plugin manager from starting.
#[derive(Debug, thiserror::Error)]
pub enum PluginManagerError {
    /// The registration directory is unusable or cannot be watched.
    #[error(transparent)]
    Watcher(#[from] WatcherError),
    /// A handler was registered twice for the same type.
    #[error("a handler for plugin type {0} is already registered")]
    DuplicateHandler(PluginType),
    /// A setting is out of range.
    #[error("invalid plugin manager setting {setting}: {reason}")]
    InvalidConfig {
        /// The setting's name.
        setting: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// Why one registration attempt of one socket failed. Each failure is retried
/// with backoff; the message is what the logs and the status endpoint show.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    /// The socket could not be dialed (often a stale socket nobody serves).
    #[error("dial failed at socket {socket}: {source}")]
    Dial {
        /// Registration socket.
        socket: PathBuf,
        /// Transport error.
        #[source]
        source: UdsError,
    },
    /// The process serving the socket is not trusted
    /// ([`crate::plugin_trust::PluginTrust`]).
    #[error("plugin socket {socket} refused: {reason}")]
    Untrusted {
        /// Registration socket.
        socket: PathBuf,
        /// Why.
        reason: String,
    },
    /// `GetInfo` returned an error.
    #[error("failed to get plugin info using RPC GetInfo at socket {socket}: {status}")]
    GetInfo {
        /// Registration socket.
        socket: PathBuf,
        /// The gRPC status.
        status: tonic::Status,
    },
    /// `GetInfo` did not answer within its deadline.
    #[error("GetInfo at socket {socket} did not answer within {timeout:?}")]
    GetInfoTimeout {
        /// Registration socket.
        socket: PathBuf,
        /// The deadline.
        timeout: Duration,
    },
    /// No handler is registered for the type the plugin reported.
    #[error("no handler registered for plugin type: {plugin_type} at socket {socket}")]
    UnknownType {
        /// The reported type.
        plugin_type: String,
        /// Registration socket.
        socket: PathBuf,
    },
    /// The plugin reported an empty name.
    #[error("plugin of type {plugin_type} at socket {socket} reported an empty name")]
    EmptyName {
        /// The reported type.
        plugin_type: PluginType,
        /// Registration socket.
        socket: PathBuf,
    },
    /// The handler rejected the plugin in `validate`.
    #[error("plugin validation failed for {plugin_type} plugin {name:?} at socket {socket}: {source}")]
    Validation {
        /// Plugin type.
        plugin_type: PluginType,
        /// Plugin name.
        name: String,
        /// Registration socket.
        socket: PathBuf,
        /// The handler's reason.
        #[source]
        source: HandlerError,
    },
    /// The handler failed in `register`; its partial work was undone.
    #[error("plugin registration failed for {plugin_type} plugin {name:?} at socket {socket}: {source}")]
    Register {
        /// Plugin type.
        plugin_type: PluginType,
        /// Plugin name.
        name: String,
        /// Registration socket.
        socket: PathBuf,
        /// The handler's reason.
        #[source]
        source: HandlerError,
    },
    /// The handler did not finish `validate` or `register` in time; what it
    /// did was undone.
    #[error(
        "plugin handler for {plugin_type} plugin {name:?} at socket {socket} did not finish {step} within {timeout:?}"
    )]
    HandlerTimeout {
        /// Plugin type.
        plugin_type: PluginType,
        /// Plugin name.
        name: String,
        /// Registration socket.
        socket: PathBuf,
        /// `validate` or `register`.
        step: &'static str,
        /// The deadline.
        timeout: Duration,
    },
    /// The verdict could not be delivered; the registration was rolled back.
    #[error("failed to send registration status at socket {socket}: {reason}")]
    Notify {
        /// Registration socket.
        socket: PathBuf,
        /// gRPC status or deadline.
        reason: String,
    },
    /// The registration task panicked or was aborted.
    #[error("registration task for socket {socket} failed: {reason}")]
    TaskFailed {
        /// Registration socket.
        socket: PathBuf,
        /// The panic or abort.
        reason: String,
    },
}

impl RegistrationError {
    /// True when the plugin answered but a handler turned it down: such a
    /// plugin may succeed as soon as another plugin goes away (for example a
    /// second socket for the same CSI driver name), so it is retried at once
    /// when any plugin is deregistered instead of waiting out its backoff.
    pub(crate) fn rejected_by_handler(&self) -> bool {
        matches!(self, RegistrationError::Validation { .. } | RegistrationError::Register { .. })
    }

    /// True when the handler had registered the plugin and was told to undo
    /// it: the handlers' state changed, which may let another plugin in.
    pub(crate) fn rolled_back(&self) -> bool {
        matches!(
            self,
            RegistrationError::Register { .. }
                | RegistrationError::Notify { .. }
                | RegistrationError::HandlerTimeout { step: "register", .. }
                | RegistrationError::TaskFailed { .. }
        )
    }
}
