//! The reconciler: one task that owns the desired and actual state and drives
//! every socket towards "registered if it exists, deregistered if not".
//!
//! It wakes on file-system events, on finished operations, on backoff timers
//! and on a slow periodic resync (the safety net), never on a fixed poll.
//! After each wake-up it drains whatever else is ready and reconciles only the
//! sockets those messages touched ("dirty" paths), so a burst of thousands of
//! sockets costs one pass per batch, not one full pass per socket.
//!
//! # Guarantees
//! - At most one operation per socket path runs at a time; different paths run
//!   concurrently (bounded by `max_concurrent_operations`).
//! - Unregistrations of a batch finish before its registrations start.
//! - A recreated socket (new UUID) is deregistered, then registered anew, and
//!   starts with a fresh backoff.
//! - A failed path is retried after its backoff; a path whose failure was a
//!   handler's rejection is retried at once when another plugin goes away.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::{Semaphore, broadcast, mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use super::PluginManagerConfig;
use super::actual_state::{ActualState, RegisteredPlugin};
use super::backoff::Backoff;
use super::desired_state::{Change, DesiredState, FileId};
use super::error::RegistrationError;
use super::metrics::{Metrics, World};
use super::operation::{self, Deadlines, HandlerMap, Registered};
use super::status::{PluginCounts, PluginEvent, PluginState, PluginStatus};
use super::watcher::{self, Entry, FsEvent, Watcher};

/// Questions the handle can ask the reconciler.
pub(crate) enum Request {
    Status(oneshot::Sender<Vec<PluginStatus>>),
}

/// Per-socket bookkeeping of the operation executor.
struct PathOps {
    in_flight: bool,
    backoff: Backoff,
    retry_at: Option<Instant>,
    failures: u32,
    last_error: Option<String>,
    rejected_by_handler: bool,
}

/// The end of one register operation.
struct Outcome {
    path: PathBuf,
    uuid: Uuid,
    result: Result<Registered, RegistrationError>,
}

/// Most messages handled before the dirty paths are reconciled.
const BATCH: usize = 4096;

pub(crate) struct Reconciler {
    root: PathBuf,
    config: PluginManagerConfig,
    handlers: Arc<HandlerMap>,
    desired: DesiredState,
    actual: ActualState,
    ops: HashMap<PathBuf, PathOps>,
    dirty: BTreeSet<PathBuf>,
    retries: BinaryHeap<Reverse<(Instant, PathBuf)>>,
    tasks: JoinSet<Outcome>,
    task_paths: HashMap<tokio::task::Id, (PathBuf, Uuid)>,
    permits: Arc<Semaphore>,
    reported_ignored: HashSet<PathBuf>,
    metrics: Metrics,
    events: broadcast::Sender<PluginEvent>,
    counts: watch::Sender<PluginCounts>,
    failed_attempts: u64,
    deregistrations: u64,
    watcher: Option<Watcher>,
    /// (device, inode) of the watched registration directory.
    root_id: Option<(u64, u64)>,
}

pub(crate) struct Channels {
    pub(crate) fs: mpsc::UnboundedReceiver<FsEvent>,
    pub(crate) requests: mpsc::Receiver<Request>,
}

impl Reconciler {
    pub(crate) fn new(
        config: PluginManagerConfig,
        handlers: HandlerMap,
        metrics: Metrics,
        events: broadcast::Sender<PluginEvent>,
        counts: watch::Sender<PluginCounts>,
    ) -> Self {
        Reconciler {
            root: config.registration_dir.clone(),
            permits: Arc::new(Semaphore::new(config.max_concurrent_operations.max(1))),
            config,
            handlers: Arc::new(handlers),
            desired: DesiredState::default(),
            actual: ActualState::default(),
            ops: HashMap::new(),
            dirty: BTreeSet::new(),
            retries: BinaryHeap::new(),
            tasks: JoinSet::new(),
            task_paths: HashMap::new(),
            reported_ignored: HashSet::new(),
            metrics,
            events,
            counts,
            failed_attempts: 0,
            deregistrations: 0,
            watcher: None,
            root_id: None,
        }
    }

    /// Hands over the inotify watch, so it lives as long as the reconciler
    /// and can be renewed if the directory is recreated.
    pub(crate) fn set_watcher(&mut self, watcher: Watcher) {
        self.watcher = Some(watcher);
        self.root_id = std::fs::metadata(&self.root).ok().map(|m| (m.dev(), m.ino()));
    }

    /// Runs until `shutdown` is cancelled. In-flight registrations are then
    /// aborted; registered plugins stay registered with their handlers.
    pub(crate) async fn run(mut self, mut ch: Channels, shutdown: CancellationToken) {
        self.rescan("start-up");
        self.reconcile().await;
        let period = self.config.resync_period;
        let mut resync = tokio::time::interval_at(Instant::now() + period, period);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next_retry = self.retries.peek().map(|Reverse((at, _))| *at);
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(joined) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    self.on_joined(joined);
                }
                Some(event) = ch.fs.recv() => self.on_fs_event(event),
                () = tokio::time::sleep_until(next_retry.unwrap_or_else(Instant::now)), if next_retry.is_some() => {
                    self.fire_retries();
                }
                _ = resync.tick() => self.rescan("periodic resync"),
                Some(request) = ch.requests.recv() => self.answer(request),
            }
            // Take everything else that is ready before reconciling once.
            for _ in 0..BATCH {
                if let Some(joined) = self.tasks.try_join_next_with_id() {
                    self.on_joined(joined);
                } else if let Ok(event) = ch.fs.try_recv() {
                    self.on_fs_event(event);
                } else {
                    break;
                }
            }
            self.reconcile().await;
            self.publish_counts();
        }
        // Stop answering (handles see the manager as closed), then drain.
        drop(ch);
        self.drain().await;
        tracing::info!(registered = self.actual.len(), "plugin manager stopped");
    }

    /// Lets running registrations finish within the grace period, then aborts
    /// the rest. No new operation starts.
    async fn drain(&mut self) {
        let grace = self.config.shutdown_grace;
        let finish = async {
            while let Some(joined) = self.tasks.join_next_with_id().await {
                self.on_joined(joined);
            }
        };
        if tokio::time::timeout(grace, finish).await.is_err() {
            tracing::warn!(
                running = self.tasks.len(),
                ?grace,
                "aborting plugin registrations still running at shutdown"
            );
            self.tasks.shutdown().await;
        }
    }

    // ----- file system -----

    fn on_fs_event(&mut self, event: FsEvent) {
        match event {
            FsEvent::Rescan(reason) => self.rescan(reason),
            FsEvent::Changed(path) if path == self.root => self.rescan("registration directory changed"),
            FsEvent::Changed(path) if path.starts_with(&self.root) => self.look_at(&path),
            FsEvent::Changed(_) => {}
        }
    }

    /// Brings the desired state under `path` in line with the disk.
    fn look_at(&mut self, path: &Path) {
        match watcher::classify(&self.root, path) {
            Entry::Socket(id) => self.desire(path, id),
            Entry::Directory => self.sync_tree(path),
            Entry::Missing => {
                self.reported_ignored.remove(path);
                self.forget_tree(path);
            }
            Entry::Ignored(why) => {
                // A socket may have been replaced by something else.
                self.forget_tree(path);
                if watcher::looks_like_socket(path) && self.reported_ignored.insert(path.to_path_buf()) {
                    tracing::info!(path = %path.display(), reason = why, "ignoring entry in plugin registration directory");
                }
            }
        }
    }

    fn rescan(&mut self, reason: &'static str) {
        tracing::debug!(reason, "rescanning plugin registration directory");
        let root = self.root.clone();
        self.check_root();
        self.sync_tree(&root);
        // Safety net: anything unsettled gets another look.
        let unsettled: Vec<PathBuf> = self
            .desired
            .paths()
            .filter(|p| self.actual.get(p).is_none())
            .chain(self.actual.iter().map(|(p, _)| p))
            .cloned()
            .collect();
        self.dirty.extend(unsettled);
    }

    /// The registration directory may have been deleted (every plugin under
    /// it is then gone) and possibly created again by someone else: a watch
    /// dies with the directory it watched, so make the directory if needed
    /// and watch it anew whenever it is not the one being watched.
    fn check_root(&mut self) {
        let current = std::fs::metadata(&self.root).ok().filter(|m| m.is_dir()).map(|m| (m.dev(), m.ino()));
        if current.is_some() && current == self.root_id {
            return;
        }
        if current.is_none() {
            tracing::error!(dir = %self.root.display(), "plugin registration directory disappeared; recreating it");
        } else if self.root_id.is_some() {
            tracing::warn!(dir = %self.root.display(), "plugin registration directory was replaced; watching the new one");
        }
        let result = watcher::prepare_dir(&self.root)
            .and_then(|()| self.watcher.as_mut().map_or(Ok(()), |w| w.rewatch(&self.root)));
        match result {
            Ok(()) => self.root_id = std::fs::metadata(&self.root).ok().map(|m| (m.dev(), m.ino())),
            Err(error) => {
                tracing::error!(%error, "cannot watch the plugin registration directory; retrying at the next resync")
            }
        }
    }

    /// Walks the directory `dir`: sockets found are desired, desired sockets
    /// below it that are gone are forgotten.
    fn sync_tree(&mut self, dir: &Path) {
        let scan = watcher::scan(&self.root, dir);
        let found: HashSet<&Path> = scan.sockets.iter().map(|(p, _)| p.as_path()).collect();
        let gone: Vec<PathBuf> =
            self.desired.paths_under(dir).into_iter().filter(|p| !found.contains(p.as_path())).collect();
        for path in gone {
            self.forget_tree(&path);
        }
        for (path, id) in &scan.sockets {
            self.desire(path, *id);
        }
        for (path, why) in scan.ignored {
            if self.reported_ignored.insert(path.clone()) {
                tracing::info!(path = %path.display(), reason = why, "ignoring entry in plugin registration directory");
            }
        }
    }

    fn desire(&mut self, path: &Path, id: FileId) {
        match self.desired.add_or_update(path, id) {
            Ok(Change::Unchanged) => {}
            Ok(change) => {
                tracing::debug!(socket = %path.display(), ?change, "plugin socket seen");
                self.metrics.set(World::Desired, path, true);
                // A new socket instance deserves a fresh start, not the old
                // instance's backoff.
                if let Some(ops) = self.ops.get_mut(path) {
                    ops.backoff.reset();
                    ops.failures = 0;
                    ops.retry_at = None;
                }
                self.dirty.insert(path.to_path_buf());
            }
            Err(error) => tracing::warn!(%error, "cannot track plugin socket"),
        }
    }

    fn forget_tree(&mut self, path: &Path) {
        for removed in self.desired.remove_tree(path) {
            tracing::debug!(socket = %removed.display(), "plugin socket gone");
            self.metrics.set(World::Desired, &removed, false);
            self.dirty.insert(removed);
        }
    }

    // ----- reconciling -----

    async fn reconcile(&mut self) {
        if self.dirty.is_empty() {
            return;
        }
        let mut dirty = std::mem::take(&mut self.dirty);
        let mut deregistered = false;
        for path in &dirty {
            if self.in_flight(path) {
                continue;
            }
            let stale = match (self.actual.get(path), self.desired.get(path)) {
                (Some(actual), Some(desired)) => actual.uuid != desired.uuid,
                (Some(_), None) => true,
                (None, _) => false,
            };
            if stale {
                self.unregister(path).await;
                deregistered = true;
            }
        }
        if deregistered {
            // Plugins turned down by a handler (say, a second socket for a CSI
            // driver name) may fit now: try them at once.
            for (path, ops) in &mut self.ops {
                if ops.rejected_by_handler && ops.retry_at.is_some() && !ops.in_flight {
                    ops.retry_at = None;
                    dirty.insert(path.clone());
                }
            }
        }
        let now = Instant::now();
        for path in dirty {
            if self.in_flight(&path) {
                continue;
            }
            match (self.desired.get(&path), self.actual.get(&path)) {
                (Some(desired), None) => {
                    let due = self.ops.get(&path).and_then(|o| o.retry_at).is_none_or(|at| at <= now);
                    if due {
                        let uuid = desired.uuid;
                        self.spawn_register(path, uuid);
                    }
                }
                (None, None) => {
                    self.ops.remove(&path);
                }
                _ => {}
            }
        }
    }

    fn in_flight(&self, path: &Path) -> bool {
        self.ops.get(path).is_some_and(|o| o.in_flight)
    }

    async fn unregister(&mut self, path: &Path) {
        let Some(plugin) = self.actual.remove(path) else { return };
        let span = tracing::info_span!(
            "deregister_plugin",
            socket = %path.display(),
            plugin = %plugin.info.name,
            plugin_type = %plugin.info.plugin_type,
        );
        let timeout = self.config.deregister_timeout;
        let finished =
            tokio::time::timeout(timeout, plugin.handler.deregister(&plugin.info)).instrument(span.clone()).await;
        self.metrics.set(World::Actual, path, false);
        self.metrics.operation("unregister", finished.is_ok());
        let _enter = span.enter();
        match finished {
            Ok(()) => tracing::info!("plugin deregistered"),
            Err(_) => tracing::warn!(?timeout, "plugin handler did not finish deregistering in time; moving on"),
        }
        self.deregistrations += 1;
        let _ = self.events.send(PluginEvent::Deregistered(plugin.info));
    }

    fn spawn_register(&mut self, path: PathBuf, uuid: Uuid) {
        let ops = self.ops.entry(path.clone()).or_insert_with(|| PathOps {
            in_flight: false,
            backoff: Backoff::new(self.config.initial_backoff, self.config.max_backoff),
            retry_at: None,
            failures: 0,
            last_error: None,
            rejected_by_handler: false,
        });
        ops.in_flight = true;
        ops.retry_at = None;
        let handlers = Arc::clone(&self.handlers);
        let permits = Arc::clone(&self.permits);
        let deadlines = Deadlines {
            dial: self.config.dial_timeout,
            get_info: self.config.get_info_timeout,
            notify: self.config.notify_timeout,
        };
        let span = tracing::info_span!("register_plugin", socket = %path.display());
        let task_path = path.clone();
        let abort = self.tasks.spawn(
            async move {
                // Closed only on shutdown, when the task is aborted anyway.
                let _permit = permits.acquire_owned().await;
                let result = operation::register(&task_path, &handlers, deadlines).await;
                Outcome { path: task_path, uuid, result }
            }
            .instrument(span),
        );
        self.task_paths.insert(abort.id(), (path, uuid));
    }

    fn on_joined(&mut self, joined: Result<(tokio::task::Id, Outcome), tokio::task::JoinError>) {
        let outcome = match joined {
            Ok((id, outcome)) => {
                self.task_paths.remove(&id);
                outcome
            }
            Err(join_error) => {
                let Some((path, uuid)) = self.task_paths.remove(&join_error.id()) else { return };
                tracing::error!(socket = %path.display(), error = %join_error, "registration task failed");
                let error = RegistrationError::Notify {
                    socket: path.clone(),
                    reason: format!("registration task failed: {join_error}"),
                };
                Outcome { path, uuid, result: Err(error) }
            }
        };
        self.on_outcome(outcome);
    }

    fn on_outcome(&mut self, outcome: Outcome) {
        let Outcome { path, uuid, result } = outcome;
        let Some(ops) = self.ops.get_mut(&path) else { return };
        ops.in_flight = false;
        match result {
            Ok(Registered { info, handler }) => {
                ops.backoff.reset();
                ops.failures = 0;
                ops.last_error = None;
                ops.rejected_by_handler = false;
                // State and metrics first: whoever sees the log line or the
                // event can rely on them.
                self.metrics.set(World::Actual, &path, true);
                self.metrics.operation("register", true);
                self.actual.add(path.clone(), RegisteredPlugin { uuid, info: info.clone(), handler });
                tracing::info!(
                    socket = %path.display(),
                    plugin = %info.name,
                    plugin_type = %info.plugin_type,
                    endpoint = %info.endpoint,
                    versions = ?info.supported_versions,
                    "plugin registered"
                );
                let _ = self.events.send(PluginEvent::Registered(info));
            }
            Err(error) => {
                let delay = ops.backoff.fail();
                ops.failures += 1;
                let at = Instant::now() + delay;
                ops.retry_at = Some(at);
                ops.rejected_by_handler = error.rejected_by_handler();
                let message = error.to_string();
                // First failure, or a different one: say it loudly. The same
                // failure again (a stale socket, say) only at debug level.
                if ops.failures == 1 || ops.last_error.as_deref() != Some(message.as_str()) {
                    tracing::warn!(socket = %path.display(), failures = ops.failures, retry_in = ?delay, "plugin registration failed: {message}");
                } else {
                    tracing::debug!(socket = %path.display(), failures = ops.failures, retry_in = ?delay, "plugin registration failed again: {message}");
                }
                let failures = ops.failures;
                ops.last_error = Some(message.clone());
                self.failed_attempts += 1;
                self.metrics.operation("register", false);
                self.retries.push(Reverse((at, path.clone())));
                let _ = self.events.send(PluginEvent::RegistrationFailed {
                    socket_path: path.clone(),
                    error: message,
                    failures,
                });
            }
        }
        self.dirty.insert(path);
    }

    fn fire_retries(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, _))) = self.retries.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((at, path))) = self.retries.pop() else { break };
            // Entries superseded by a newer schedule (or a forgotten path) are skipped.
            if let Some(ops) = self.ops.get_mut(&path)
                && ops.retry_at == Some(at)
                && !ops.in_flight
            {
                ops.retry_at = None;
                self.dirty.insert(path);
            }
        }
    }

    // ----- reporting -----

    fn publish_counts(&self) {
        let counts = PluginCounts {
            desired: self.desired.len(),
            registered: self.actual.len(),
            registering: self.task_paths.len(),
            failed_attempts: self.failed_attempts,
            deregistrations: self.deregistrations,
        };
        self.counts.send_if_modified(|current| {
            let changed = *current != counts;
            *current = counts;
            changed
        });
    }

    fn answer(&self, request: Request) {
        match request {
            Request::Status(reply) => {
                let _ = reply.send(self.status());
            }
        }
    }

    fn status(&self) -> Vec<PluginStatus> {
        let now = Instant::now();
        let mut paths: BTreeSet<&PathBuf> = self.desired.paths().collect();
        paths.extend(self.actual.iter().map(|(p, _)| p));
        paths
            .into_iter()
            .map(|path| {
                let ops = self.ops.get(path);
                let registered = self.actual.get(path);
                let state = if ops.is_some_and(|o| o.in_flight) {
                    PluginState::Registering
                } else if registered.is_some() {
                    PluginState::Registered
                } else if ops.is_some_and(|o| o.retry_at.is_some()) {
                    PluginState::BackingOff
                } else {
                    PluginState::Pending
                };
                PluginStatus {
                    socket_path: path.clone(),
                    state,
                    plugin: registered.map(|r| r.info.clone()),
                    failures: ops.map_or(0, |o| o.failures),
                    last_error: ops.and_then(|o| o.last_error.clone()),
                    retry_in_ms: ops
                        .and_then(|o| o.retry_at)
                        .map(|at| at.saturating_duration_since(now).as_millis() as u64),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reconciler(dir: &Path) -> Reconciler {
        let (events, _) = broadcast::channel(16);
        let (counts, _) = watch::channel(PluginCounts::default());
        Reconciler::new(PluginManagerConfig::new(dir), HandlerMap::new(), Metrics::default(), events, counts)
    }

    /// What inotify did not report (a dropped event after a queue overflow)
    /// is found by the rescan that the overflow triggers.
    #[tokio::test]
    async fn rescan_finds_sockets_no_event_reported_and_drops_vanished_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let mut r = reconciler(root);
        std::fs::create_dir_all(root.join("x/y")).expect("mkdir");
        let _a = std::os::unix::net::UnixListener::bind(root.join("a.sock")).expect("bind");
        let _b = std::os::unix::net::UnixListener::bind(root.join("x/y/b.sock")).expect("bind");
        r.on_fs_event(FsEvent::Rescan("inotify queue overflow"));
        assert_eq!(r.desired.len(), 2);
        let first = r.desired.get(&root.join("a.sock")).expect("a").uuid;
        std::fs::remove_file(root.join("x/y/b.sock")).expect("rm");
        r.on_fs_event(FsEvent::Rescan("inotify queue overflow"));
        assert_eq!(r.desired.paths().cloned().collect::<Vec<_>>(), vec![root.join("a.sock")]);
        assert_eq!(r.desired.get(&root.join("a.sock")).expect("a").uuid, first, "a rescan is idempotent");
    }
}
