//! What the plugin manager tells the outside world: per-socket status,
//! counters to wait on, and a stream of registration events.

use std::path::PathBuf;

use super::handler::PluginInfo;

/// Where one socket stands.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum PluginState {
    /// Registered with its handler.
    Registered,
    /// A registration attempt is running.
    Registering,
    /// The plugin's handler is being told it is gone.
    Deregistering,
    /// The last attempt failed; the next one waits for its backoff.
    BackingOff,
    /// Seen on disk, no attempt made yet.
    Pending,
}

/// Status of one socket under the registration directory.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginStatus {
    /// The registration socket.
    pub socket_path: PathBuf,
    /// Where it stands.
    pub state: PluginState,
    /// The plugin, once registered.
    pub plugin: Option<PluginInfo>,
    /// Failed attempts since the last success or since the socket appeared.
    pub failures: u32,
    /// The last failure's message.
    pub last_error: Option<String>,
    /// Milliseconds until the next attempt, when backing off.
    pub retry_in_ms: Option<u64>,
}

/// Counters published after every batch of work; cheap to wait on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginCounts {
    /// Sockets on disk (desired state).
    pub desired: usize,
    /// Registered plugins (actual state).
    pub registered: usize,
    /// Registration attempts running now.
    pub registering: usize,
    /// Failed registration attempts since start (monotonic).
    pub failed_attempts: u64,
    /// Deregistrations since start (monotonic).
    pub deregistrations: u64,
}

/// Something that happened to a plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginEvent {
    /// A plugin was registered with its handler.
    Registered(PluginInfo),
    /// A registered plugin was deregistered (socket gone or recreated).
    Deregistered(PluginInfo),
    /// A registration attempt failed and will be retried.
    RegistrationFailed {
        /// The registration socket.
        socket_path: PathBuf,
        /// Why.
        error: String,
        /// Failed attempts in a row for this socket.
        failures: u32,
    },
}
