//! The reconciler: one task that owns the desired and actual state and drives
//! every socket towards "registered if it exists, deregistered if not".
//!
//! It wakes on file-system events, on finished operations, on backoff timers,
//! on status requests and on a slow periodic resync (the safety net), never on
//! a fixed poll. After each wake-up it drains whatever else is ready and
//! reconciles only the sockets those messages touched ("dirty" paths), so a
//! burst of thousands of sockets costs one pass per batch, not one full pass
//! per socket.
//!
//! # Guarantees
//! - At most one operation (register or deregister) per socket path runs at a
//!   time; different paths run concurrently (registrations bounded by
//!   `max_concurrent_operations`).
//! - The deregistrations of a batch finish (or pass `deregister_timeout`)
//!   before its registrations start. A handler that overruns keeps running in
//!   the background and its path stays busy until it returns.
//! - A recreated socket (new UUID) is deregistered, then registered anew, and
//!   starts with a fresh backoff; a failure of the old instance's attempt does
//!   not delay the new one.
//! - A failed path is retried after its backoff. A path turned down by a
//!   handler is retried at once when the handlers' state changes (a plugin
//!   deregistered or a registration rolled back), even if that happened while
//!   its own attempt was running.

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
use super::handler::PluginInfo;
use super::metrics::{Metrics, World};
use super::operation::{self, Deadlines, HandlerMap, Registered};
use super::status::{PluginCounts, PluginEvent, PluginState, PluginStatus};
use super::watcher::{self, Entry, FsEvent, Watcher};

/// Questions the handle can ask the reconciler.
pub(crate) enum Request {
    Status(oneshot::Sender<Vec<PluginStatus>>),
}

/// What is running for a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Running {
    Register,
    Deregister,
}

/// Per-socket bookkeeping of the operation executor.
struct PathOps {
    running: Option<Running>,
    backoff: Backoff,
    retry_at: Option<Instant>,
    failures: u32,
    last_error: Option<String>,
    rejected_by_handler: bool,
    /// The handler epoch when the running registration started.
    started_epoch: u64,
}

/// The end of one operation.
struct Outcome {
    path: PathBuf,
    uuid: Uuid,
    result: OpResult,
}

enum OpResult {
    Register(Result<Registered, RegistrationError>),
    Deregister { info: PluginInfo, took: std::time::Duration },
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
    task_paths: HashMap<tokio::task::Id, (PathBuf, Uuid, Running)>,
    permits: Arc<Semaphore>,
    reported_ignored: HashSet<PathBuf>,
    metrics: Metrics,
    events: broadcast::Sender<PluginEvent>,
    counts: watch::Sender<PluginCounts>,
    failed_attempts: u64,
    deregistrations: u64,
    /// Bumped whenever the handlers' state shrinks (a deregistration or a
    /// rolled-back registration): a plugin turned down before may fit now.
    handler_epoch: u64,
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
            handler_epoch: 0,
            watcher: None,
            root_id: None,
        }
    }

    /// Hands over the inotify watch, so it lives as long as the reconciler
    /// and can be renewed if the directory is recreated.
    pub(crate) fn set_watcher(&mut self, watcher: Watcher) {
        self.watcher = Some(watcher);
        self.root_id = dir_id(&self.root);
    }

    /// Runs until `shutdown` is cancelled, then lets running operations finish
    /// within the shutdown grace. Registered plugins stay registered with
    /// their handlers.
    pub(crate) async fn run(mut self, mut ch: Channels, shutdown: CancellationToken) {
        self.rescan("start-up");
        self.settle().await;
        let period = self.config.resync_period;
        let mut resync = tokio::time::interval_at(Instant::now() + period, period);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next_retry = self.retries.peek().map(|Reverse((at, _))| *at);
            // Not biased: a stream of file events must not starve retries,
            // status requests or finished operations.
            tokio::select! {
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
            // Take everything else that is ready before reconciling.
            for _ in 0..BATCH {
                if let Some(joined) = self.tasks.try_join_next_with_id() {
                    self.on_joined(joined);
                } else if let Ok(event) = ch.fs.try_recv() {
                    self.on_fs_event(event);
                } else {
                    break;
                }
            }
            self.settle().await;
        }
        // Stop answering (handles see the manager as closed), then drain.
        drop(ch);
        self.drain().await;
        tracing::info!(registered = self.actual.len(), "plugin manager stopped");
    }

    /// Reconciles until no path is dirty, then publishes the counters.
    async fn settle(&mut self) {
        while !self.dirty.is_empty() {
            self.reconcile().await;
        }
        self.publish_counts();
    }

    /// Lets running operations finish within the grace period, then aborts
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
                "aborting plugin operations still running at shutdown; their handlers may hold partial registrations"
            );
            self.tasks.shutdown().await;
        }
    }

    // ----- file system -----

    fn on_fs_event(&mut self, event: FsEvent) {
        match event {
            FsEvent::Rescan(reason) => self.rescan(reason),
            FsEvent::Changed { path, removed } if path == self.root => {
                if removed {
                    // Whatever is there now is not the directory we watched,
                    // even if it got the same inode back.
                    self.root_id = None;
                }
                self.rescan("registration directory changed");
            }
            FsEvent::Changed { path, removed } if path.starts_with(&self.root) => self.look_at(&path, removed),
            FsEvent::Changed { .. } => {}
        }
    }

    /// Brings the desired state under `path` in line with the disk.
    fn look_at(&mut self, path: &Path, removed: bool) {
        match watcher::classify(&self.root, path) {
            Entry::Socket(id) => {
                // It may have been a directory (renamed away, a socket bound
                // in its place before we looked).
                self.forget_below(path);
                self.desire(path, id, removed);
            }
            Entry::Directory => self.sync_tree(path),
            Entry::Missing => self.forget_tree(path),
            Entry::Ignored(why) => {
                // A socket may have been replaced by something else.
                self.forget_tree(path);
                self.report_ignored(path.to_path_buf(), why);
            }
            Entry::Unreadable(kind) => {
                tracing::warn!(path = %path.display(), error = ?kind, "cannot examine path in plugin registration directory; keeping what is known about it");
            }
        }
    }

    fn report_ignored(&mut self, path: PathBuf, why: &'static str) {
        if watcher::looks_like_socket(&path) && !self.reported_ignored.contains(&path) {
            tracing::info!(path = %path.display(), reason = why, "ignoring entry in plugin registration directory");
            self.reported_ignored.insert(path);
        }
    }

    fn rescan(&mut self, reason: &'static str) {
        tracing::debug!(reason, "rescanning plugin registration directory");
        self.check_root();
        let root = self.root.clone();
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
        let current = dir_id(&self.root);
        if current.is_some() && current == self.root_id {
            return;
        }
        if current.is_none() {
            tracing::error!(dir = %self.root.display(), "plugin registration directory disappeared; recreating it");
        } else {
            tracing::warn!(dir = %self.root.display(), "plugin registration directory was replaced; watching the new one");
        }
        let result = watcher::prepare_dir(&self.root)
            .and_then(|()| self.watcher.as_mut().map_or(Ok(()), |w| w.rewatch(&self.root)));
        match result {
            Ok(()) => self.root_id = dir_id(&self.root),
            Err(error) => {
                tracing::error!(%error, "cannot watch the plugin registration directory; retrying at the next resync")
            }
        }
    }

    /// Walks the directory `dir`: sockets found are desired, desired sockets
    /// below it that are gone are forgotten (unless the walk could not see
    /// them).
    fn sync_tree(&mut self, dir: &Path) {
        // Watch each directory before reading it: a socket created after the
        // read is then reported by the watch.
        let watcher = &mut self.watcher;
        let scan = watcher::scan(&self.root, dir, &mut |d| {
            if let Some(w) = watcher.as_mut() {
                w.watch_dir(d);
            }
        });
        let found: HashSet<&Path> = scan.sockets.iter().map(|(p, _)| p.as_path()).collect();
        let gone: Vec<PathBuf> = self
            .desired
            .paths_under(dir)
            .into_iter()
            .filter(|p| !found.contains(p.as_path()) && !scan.is_unknown(p))
            .collect();
        for path in gone {
            self.forget_tree(&path);
        }
        for (path, id) in &scan.sockets {
            self.desire(path, *id, false);
        }
        for (path, why) in scan.ignored {
            self.report_ignored(path, why);
        }
        for (path, kind) in scan.unreadable {
            tracing::warn!(path = %path.display(), error = ?kind, "cannot read part of the plugin registration directory; keeping what is known about it");
        }
    }

    fn desire(&mut self, path: &Path, id: FileId, removed: bool) {
        match self.desired.add_or_update(path, id, removed) {
            Ok(Change::Unchanged) => {}
            Ok(change) => {
                tracing::debug!(socket = %path.display(), ?change, "plugin socket seen");
                self.reported_ignored.remove(path);
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

    /// Forgets `path` and everything below it.
    fn forget_tree(&mut self, path: &Path) {
        if let Some(w) = self.watcher.as_mut() {
            w.unwatch_tree(path);
        }
        if !self.reported_ignored.is_empty() {
            self.reported_ignored.retain(|p| !p.starts_with(path));
        }
        for removed in self.desired.remove_tree(path) {
            tracing::debug!(socket = %removed.display(), "plugin socket gone");
            self.metrics.set(World::Desired, &removed, false);
            self.dirty.insert(removed);
        }
    }

    /// Forgets everything strictly below `path`.
    fn forget_below(&mut self, path: &Path) {
        let below: Vec<PathBuf> = self.desired.paths_under(path).into_iter().filter(|p| p != path).collect();
        for p in below {
            self.forget_tree(&p);
        }
    }

    // ----- reconciling -----

    async fn reconcile(&mut self) {
        let dirty = std::mem::take(&mut self.dirty);
        // Deregistrations first, and waited for (up to the deadline), so that
        // a driver moving to another socket is gone before the new socket
        // registers.
        let mut pending = HashSet::new();
        for path in &dirty {
            if self.running(path).is_some() {
                continue;
            }
            let stale = match (self.actual.get(path), self.desired.get(path)) {
                (Some(actual), Some(desired)) => actual.uuid != desired.uuid,
                (Some(_), None) => true,
                (None, _) => false,
            };
            if stale && let Some(id) = self.spawn_deregister(path) {
                pending.insert(id);
            }
        }
        if !pending.is_empty() {
            let deadline = Instant::now() + self.config.deregister_timeout;
            while !pending.is_empty() {
                match tokio::time::timeout_at(deadline, self.tasks.join_next_with_id()).await {
                    Ok(Some(joined)) => {
                        let id = match &joined {
                            Ok((id, _)) => *id,
                            Err(e) => e.id(),
                        };
                        pending.remove(&id);
                        self.on_joined(joined);
                    }
                    Ok(None) => break,
                    Err(_) => {
                        tracing::warn!(
                            running = pending.len(),
                            timeout = ?self.config.deregister_timeout,
                            "plugin handlers are slow to deregister; registering the rest meanwhile"
                        );
                        break;
                    }
                }
            }
        }
        let now = Instant::now();
        for path in dirty {
            if self.running(&path).is_some() {
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

    fn running(&self, path: &Path) -> Option<Running> {
        self.ops.get(path).and_then(|o| o.running)
    }

    fn ops_entry(&mut self, path: &Path) -> &mut PathOps {
        let (initial, max) = (self.config.initial_backoff, self.config.max_backoff);
        self.ops.entry(path.to_path_buf()).or_insert_with(|| PathOps {
            running: None,
            backoff: Backoff::new(initial, max),
            retry_at: None,
            failures: 0,
            last_error: None,
            rejected_by_handler: false,
            started_epoch: 0,
        })
    }

    /// Starts deregistering the plugin at `path`; returns the task id.
    fn spawn_deregister(&mut self, path: &Path) -> Option<tokio::task::Id> {
        let plugin = self.actual.remove(path)?;
        self.metrics.set(World::Actual, path, false);
        self.ops_entry(path).running = Some(Running::Deregister);
        let span = tracing::info_span!(
            "deregister_plugin",
            socket = %path.display(),
            plugin = %plugin.info.name,
            plugin_type = %plugin.info.plugin_type,
        );
        let task_path = path.to_path_buf();
        let RegisteredPlugin { uuid, info, handler } = plugin;
        let abort = self.tasks.spawn(
            async move {
                let started = Instant::now();
                handler.deregister(&info).await;
                Outcome { path: task_path, uuid, result: OpResult::Deregister { info, took: started.elapsed() } }
            }
            .instrument(span),
        );
        self.task_paths.insert(abort.id(), (path.to_path_buf(), uuid, Running::Deregister));
        Some(abort.id())
    }

    fn spawn_register(&mut self, path: PathBuf, uuid: Uuid) {
        let epoch = self.handler_epoch;
        let ops = self.ops_entry(&path);
        ops.running = Some(Running::Register);
        ops.retry_at = None;
        ops.started_epoch = epoch;
        let handlers = Arc::clone(&self.handlers);
        let permits = Arc::clone(&self.permits);
        let deadlines = Deadlines {
            dial: self.config.dial_timeout,
            get_info: self.config.get_info_timeout,
            notify: self.config.notify_timeout,
            handler: self.config.handler_timeout,
        };
        let span = tracing::info_span!("register_plugin", socket = %path.display());
        let task_path = path.clone();
        let abort = self.tasks.spawn(
            async move {
                // Closed only on shutdown, when the task is aborted anyway.
                let _permit = permits.acquire_owned().await;
                let result = operation::register(&task_path, &handlers, deadlines).await;
                Outcome { path: task_path, uuid, result: OpResult::Register(result) }
            }
            .instrument(span),
        );
        self.task_paths.insert(abort.id(), (path, uuid, Running::Register));
    }

    fn on_joined(&mut self, joined: Result<(tokio::task::Id, Outcome), tokio::task::JoinError>) {
        let outcome = match joined {
            Ok((id, outcome)) => {
                self.task_paths.remove(&id);
                outcome
            }
            Err(join_error) => {
                let Some((path, uuid, running)) = self.task_paths.remove(&join_error.id()) else { return };
                tracing::error!(socket = %path.display(), error = %join_error, ?running, "plugin operation task failed");
                if let Some(ops) = self.ops.get_mut(&path) {
                    ops.running = None;
                }
                // The handler may hold partial state: treat it as changed.
                self.bump_epoch();
                if running == Running::Register {
                    let error = RegistrationError::TaskFailed { socket: path.clone(), reason: join_error.to_string() };
                    self.on_register_failed(path, uuid, error);
                } else {
                    self.dirty.insert(path);
                }
                return;
            }
        };
        match outcome.result {
            OpResult::Register(Ok(registered)) => self.on_registered(outcome.path, outcome.uuid, registered),
            OpResult::Register(Err(error)) => self.on_register_failed(outcome.path, outcome.uuid, error),
            OpResult::Deregister { info, took } => self.on_deregistered(outcome.path, info, took),
        }
    }

    fn on_registered(&mut self, path: PathBuf, uuid: Uuid, Registered { info, handler }: Registered) {
        if let Some(ops) = self.ops.get_mut(&path) {
            ops.running = None;
            ops.backoff.reset();
            ops.failures = 0;
            ops.last_error = None;
            ops.rejected_by_handler = false;
        }
        // State and metrics first: whoever sees the log line or the event can
        // rely on them.
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
        self.dirty.insert(path);
    }

    fn on_register_failed(&mut self, path: PathBuf, uuid: Uuid, error: RegistrationError) {
        self.failed_attempts += 1;
        self.metrics.operation("register", false);
        if error.rolled_back() {
            self.bump_epoch();
        }
        let current = self.desired.get(&path).map(|d| d.uuid);
        let epoch = self.handler_epoch;
        let Some(ops) = self.ops.get_mut(&path) else { return };
        ops.running = None;
        let message = error.to_string();
        if current != Some(uuid) {
            // The socket was removed or recreated meanwhile: this failure
            // belongs to an instance that is gone; the new one starts fresh.
            tracing::debug!(socket = %path.display(), "registration of a replaced socket failed: {message}");
            self.dirty.insert(path);
            return;
        }
        ops.failures += 1;
        ops.rejected_by_handler = error.rejected_by_handler();
        let failures = ops.failures;
        // First failure, or a different one: say it loudly. The same failure
        // again (a stale socket, say) only at debug level.
        let repeated = ops.failures > 1 && ops.last_error.as_deref() == Some(message.as_str());
        ops.last_error = Some(message.clone());
        if ops.rejected_by_handler && ops.started_epoch != epoch {
            // Turned down while the handlers' state changed: try again now.
            tracing::debug!(socket = %path.display(), "plugin turned down while handlers changed; retrying now: {message}");
            self.dirty.insert(path.clone());
        } else {
            let delay = ops.backoff.fail();
            let at = Instant::now() + delay;
            ops.retry_at = Some(at);
            self.retries.push(Reverse((at, path.clone())));
            if repeated {
                tracing::debug!(socket = %path.display(), failures, retry_in = ?delay, "plugin registration failed again: {message}");
            } else {
                tracing::warn!(socket = %path.display(), failures, retry_in = ?delay, "plugin registration failed: {message}");
            }
        }
        let _ = self.events.send(PluginEvent::RegistrationFailed { socket_path: path, error: message, failures });
    }

    fn on_deregistered(&mut self, path: PathBuf, info: PluginInfo, took: std::time::Duration) {
        if let Some(ops) = self.ops.get_mut(&path) {
            ops.running = None;
        }
        self.metrics.operation("unregister", took <= self.config.deregister_timeout);
        if took > self.config.deregister_timeout {
            tracing::warn!(socket = %path.display(), plugin = %info.name, ?took, "plugin deregistered, late");
        } else {
            tracing::info!(socket = %path.display(), plugin = %info.name, plugin_type = %info.plugin_type, "plugin deregistered");
        }
        self.deregistrations += 1;
        self.bump_epoch();
        let _ = self.events.send(PluginEvent::Deregistered(info));
        self.dirty.insert(path);
    }

    /// The handlers' state shrank: plugins they turned down may fit now.
    fn bump_epoch(&mut self) {
        self.handler_epoch += 1;
        for (path, ops) in &mut self.ops {
            if ops.rejected_by_handler && ops.retry_at.is_some() && ops.running.is_none() {
                ops.retry_at = None;
                self.dirty.insert(path.clone());
            }
        }
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
                && ops.running.is_none()
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
            registering: self.task_paths.values().filter(|(_, _, r)| *r == Running::Register).count(),
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
                let state = match (ops.and_then(|o| o.running), registered) {
                    (Some(Running::Register), _) => PluginState::Registering,
                    (Some(Running::Deregister), _) => PluginState::Deregistering,
                    (None, Some(_)) => PluginState::Registered,
                    (None, None) if ops.is_some_and(|o| o.retry_at.is_some()) => PluginState::BackingOff,
                    (None, None) => PluginState::Pending,
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

/// (device, inode) of the directory at `path`, if it is one.
fn dir_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().filter(|m| m.is_dir()).map(|m| (m.dev(), m.ino()))
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
