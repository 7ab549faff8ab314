//! The plugin registration service.
//!
//! Plugins announce themselves by creating a Unix socket under
//! `<root-dir>/plugins_registry` and serving `pluginregistration.Registration`
//! on it. The plugin manager finds the socket, asks the plugin who it is,
//! hands it to the [`PluginHandler`] for its [`PluginType`], and tells the
//! plugin the verdict.
//!
//! # Flow
//! ```text
//! inotify ─▶ watcher ─▶ reconciler (owns desired + actual state)
//!                          │  dirty paths: unregister first, then register
//!                          ▼
//!                per-socket operation (one at a time per path, backoff)
//!                dial → GetInfo → handler.validate → handler.register → Notify
//! ```
//!
//! # Guarantees
//! - Event-driven: a socket is registered as soon as inotify reports it; a
//!   periodic resync (default 30 s) only catches what events could not tell.
//! - One hung or stale plugin never delays another: every RPC has a deadline
//!   and different sockets are registered concurrently.
//! - Failures back off per socket (500 ms doubling to 2 min 2 s) and are
//!   logged loudly once, then quietly while they repeat.
//! - A registration directory deleted under the node is recreated and watched
//!   again, so plugins that recreate their sockets register again.
//! - On shutdown, running operations get `shutdown_grace` to finish; only
//!   what is still running after that is aborted.
//!
//! # Caveats
//! - Symbolic links are not followed (upstream follows them): a link would let
//!   one plugin register twice, and changes to its target are not reported.
//! - A socket keeps its identity across `chmod`/`chown` (device, inode and
//!   birth time, not the change time, identify it).
//! - Names starting with `.` are ignored at any depth below the directory.

mod actual_state;
mod backoff;
mod desired_state;
mod error;
mod executor;
mod fs_sync;
mod handler;
mod metrics;
mod operation;
mod reconciler;
mod status;
mod status_board;
mod watcher;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use error::{PluginManagerError, RegistrationError};
pub use handler::{HandlerError, PluginHandler, PluginInfo, PluginType};
pub use status::{PluginCounts, PluginEvent, PluginState, PluginStatus};
pub use watcher::WatcherError;

use crate::health::{HealthCheck, HealthReporter};
use reconciler::Reconciler;
use status_board::StatusBoard;

/// Settings of the plugin manager. Defaults follow the upstream kubelet.
#[derive(Clone, Debug)]
pub struct PluginManagerConfig {
    /// The watched directory, usually `<root-dir>/plugins_registry`.
    pub registration_dir: PathBuf,
    /// Deadline to connect to a plugin socket (upstream: 10 s).
    pub dial_timeout: Duration,
    /// Deadline for `GetInfo` (upstream: 1 s).
    pub get_info_timeout: Duration,
    /// Deadline for `NotifyRegistrationStatus` (upstream: 5 s).
    pub notify_timeout: Duration,
    /// Backoff after the first failure of a socket (upstream: 500 ms).
    pub initial_backoff: Duration,
    /// Longest backoff (upstream: 2 min 2 s).
    pub max_backoff: Duration,
    /// How often the whole directory is rescanned as a safety net.
    pub resync_period: Duration,
    /// How long a handler's `deregister` may take before the manager stops
    /// waiting for it (it keeps running; its socket path stays busy).
    pub deregister_timeout: Duration,
    /// Deadline for each of a handler's `validate` and `register`; a
    /// `register` that overruns is undone with `deregister`.
    pub handler_timeout: Duration,
    /// Registrations running at once (bounds open connections in a burst).
    pub max_concurrent_operations: usize,
    /// On shutdown, how long running registrations may take to finish before
    /// they are aborted.
    pub shutdown_grace: Duration,
    /// File-system events queued for the reconciler at most; past that they
    /// are dropped and the directory rescanned (as after an inotify queue
    /// overflow, whose kernel default is the same 16,384).
    pub event_queue_capacity: usize,
    /// Which processes may serve a plugin socket: root and the allow-list
    /// (`--plugin-allowed-uids`); see [`crate::plugin_trust`].
    pub trust: crate::plugin_trust::PluginTrust,
}

impl PluginManagerConfig {
    /// Upstream defaults for the given registration directory.
    pub fn new(registration_dir: impl Into<PathBuf>) -> Self {
        PluginManagerConfig {
            registration_dir: registration_dir.into(),
            dial_timeout: Duration::from_secs(10),
            get_info_timeout: Duration::from_secs(1),
            notify_timeout: Duration::from_secs(5),
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(2 * 60 + 2),
            resync_period: Duration::from_secs(30),
            deregister_timeout: Duration::from_secs(5),
            handler_timeout: Duration::from_secs(60),
            max_concurrent_operations: 512,
            shutdown_grace: Duration::from_secs(5),
            event_queue_capacity: 16_384,
            trust: crate::plugin_trust::PluginTrust::default(),
        }
    }

    /// Checks every setting is in range: durations from 1 ms to 1 day, at
    /// least one concurrent operation and one queued event.
    pub(crate) fn validate(&self) -> Result<(), PluginManagerError> {
        let durations = [
            ("dial_timeout", self.dial_timeout),
            ("get_info_timeout", self.get_info_timeout),
            ("notify_timeout", self.notify_timeout),
            ("initial_backoff", self.initial_backoff),
            ("max_backoff", self.max_backoff),
            ("resync_period", self.resync_period),
            ("deregister_timeout", self.deregister_timeout),
            ("handler_timeout", self.handler_timeout),
            ("shutdown_grace", self.shutdown_grace),
        ];
        for (setting, value) in durations {
            if value < Duration::from_millis(1) || value > Duration::from_secs(86_400) {
                return Err(PluginManagerError::InvalidConfig {
                    setting,
                    reason: format!("{value:?} is outside 1ms..=24h"),
                });
            }
        }
        if self.max_backoff < self.initial_backoff {
            return Err(PluginManagerError::InvalidConfig {
                setting: "max_backoff",
                reason: format!("{:?} is below initial_backoff {:?}", self.max_backoff, self.initial_backoff),
            });
        }
        if self.event_queue_capacity == 0 {
            return Err(PluginManagerError::InvalidConfig {
                setting: "event_queue_capacity",
                reason: "must be at least 1".into(),
            });
        }
        if self.max_concurrent_operations == 0 {
            return Err(PluginManagerError::InvalidConfig {
                setting: "max_concurrent_operations",
                reason: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

/// Builder and owner of the plugin registration service.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use kubelet_plugins::plugin_manager::{PluginManager, PluginManagerConfig, PluginType};
/// # async fn run(handler: Arc<dyn kubelet_plugins::plugin_manager::PluginHandler>) -> Result<(), Box<dyn std::error::Error>> {
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// let mut manager = PluginManager::new(PluginManagerConfig::new("/tmp/root/plugins_registry"));
/// manager.add_handler(PluginType::Csi, handler)?;
/// let (handle, task) = manager.start(shutdown.clone())?;
/// handle.counts().wait_for(|c| c.registered > 0).await?;
/// shutdown.cancel();
/// task.await?;
/// # Ok(()) }
/// ```
pub struct PluginManager {
    config: PluginManagerConfig,
    handlers: HashMap<PluginType, Arc<dyn PluginHandler>>,
    metrics: metrics::Metrics,
}

impl PluginManager {
    /// A manager with no handlers yet.
    pub fn new(config: PluginManagerConfig) -> Self {
        PluginManager { config, handlers: HashMap::new(), metrics: metrics::Metrics::default() }
    }

    /// Routes plugins of `plugin_type` to `handler`.
    pub fn add_handler(
        &mut self,
        plugin_type: PluginType,
        handler: Arc<dyn PluginHandler>,
    ) -> Result<&mut Self, PluginManagerError> {
        if self.handlers.contains_key(&plugin_type) {
            return Err(PluginManagerError::DuplicateHandler(plugin_type));
        }
        self.handlers.insert(plugin_type, handler);
        Ok(self)
    }

    /// Adds the manager's metrics to `registry`.
    pub fn register_metrics(&mut self, registry: &mut Registry) -> &mut Self {
        self.metrics.register(registry);
        self
    }

    /// Prepares the registration directory, starts watching it and spawns the
    /// reconciler. Sockets already present are registered first. The task ends
    /// when `shutdown` is cancelled.
    pub fn start(
        self,
        shutdown: CancellationToken,
    ) -> Result<(PluginManagerHandle, JoinHandle<()>), PluginManagerError> {
        self.config.validate()?;
        let dir = self.config.registration_dir.clone();
        watcher::prepare_dir(&dir)?;
        let (fs_tx, fs_rx) = watcher::event_queue(self.config.event_queue_capacity);
        // Watching starts before the first scan, so nothing falls in between.
        let watch = watcher::start(&dir, fs_tx)?;
        let (events, _) = broadcast::channel(4096);
        let (counts_tx, counts_rx) = watch::channel(PluginCounts::default());
        let board = Arc::new(StatusBoard::default());
        let health = HealthReporter::new();
        let mut reconciler = Reconciler::new(
            self.config,
            self.handlers,
            self.metrics,
            events.clone(),
            counts_tx,
            board.clone(),
            health.clone(),
        );
        reconciler.set_watcher(watch);
        tracing::info!(dir = %dir.display(), "plugin manager watching for plugin sockets");
        let span = tracing::info_span!("plugin_manager", dir = %dir.display());
        // Not supervised here: returned to the node, which watches it (`plugin-manager-task`).
        let task = tokio::spawn(
            async move {
                reconciler.run(fs_rx, shutdown).await;
            }
            .instrument(span),
        );
        Ok((PluginManagerHandle { board, counts: counts_rx, events, health: health.check() }, task))
    }
}

/// A cheap, cloneable view of a running plugin manager.
#[derive(Clone)]
pub struct PluginManagerHandle {
    board: Arc<StatusBoard>,
    health: HealthCheck,
    counts: watch::Receiver<PluginCounts>,
    events: broadcast::Sender<PluginEvent>,
}

impl PluginManagerHandle {
    /// Status of every socket, sorted by path, as of the reconciler's last
    /// batch. Never waits for the reconciler (it may be busy waiting for slow
    /// deregistrations).
    pub fn status(&self) -> Vec<PluginStatus> {
        self.board.snapshot()
    }

    /// Resolves once the manager has begun shutting down; running
    /// registrations may still be finishing within the shutdown grace.
    pub async fn closed(&self) {
        self.board.closed().await;
    }

    /// The manager's health: failing while the registration directory
    /// cannot be watched (it was deleted and cannot be recreated, say).
    pub fn health(&self) -> HealthCheck {
        self.health.clone()
    }

    /// Counters updated after every batch of work.
    pub fn counts(&self) -> watch::Receiver<PluginCounts> {
        self.counts.clone()
    }

    /// Registration events from now on. A receiver that falls more than 4,096
    /// events behind sees `Lagged` and should re-read [`status`](Self::status).
    pub fn subscribe(&self) -> broadcast::Receiver<PluginEvent> {
        self.events.subscribe()
    }
}
