//! The operation executor: runs at most one register or deregister per
//! socket path, retries failures after a per-socket backoff, and keeps the
//! actual state in line with the outcomes.
//!
//! # Guarantees
//! - At most one operation (register or deregister) per socket path runs at
//!   a time; different paths run concurrently (registrations bounded by
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
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::time::Instant;
use tracing::Instrument;
use uuid::Uuid;

use super::actual_state::RegisteredPlugin;
use super::backoff::Backoff;
use super::error::RegistrationError;
use super::handler::PluginInfo;
use super::metrics::World;
use super::operation::{self, Deadlines, Registered};
use super::reconciler::Reconciler;
use super::status::PluginEvent;

/// What is running for a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Running {
    Register,
    Deregister,
}

/// Per-socket bookkeeping of the operation executor.
pub(super) struct PathOps {
    pub(super) running: Option<Running>,
    pub(super) backoff: Backoff,
    pub(super) retry_at: Option<Instant>,
    pub(super) failures: u32,
    pub(super) last_error: Option<String>,
    pub(super) rejected_by_handler: bool,
    /// The handler epoch when the running registration started.
    pub(super) started_epoch: u64,
}

/// The end of one operation.
pub(super) struct Outcome {
    path: PathBuf,
    uuid: Uuid,
    result: OpResult,
}

pub(super) enum OpResult {
    Register(Result<Registered, RegistrationError>),
    Deregister { info: PluginInfo, took: std::time::Duration },
}

impl Reconciler {
    pub(super) async fn reconcile(&mut self) {
        let dirty = std::mem::take(&mut self.dirty);
        self.touched.extend(dirty.iter().cloned());
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

    pub(super) fn running(&self, path: &Path) -> Option<Running> {
        self.ops.get(path).and_then(|o| o.running)
    }

    pub(super) fn ops_entry(&mut self, path: &Path) -> &mut PathOps {
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
    pub(super) fn spawn_deregister(&mut self, path: &Path) -> Option<tokio::task::Id> {
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
        // Not supervised: one (de)registration, tracked and abortable; it ends with the operation.
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

    pub(super) fn spawn_register(&mut self, path: PathBuf, uuid: Uuid) {
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
            deregister: self.config.deregister_timeout,
        };
        let trust = self.config.trust.clone();
        let span = tracing::info_span!("register_plugin", socket = %path.display());
        let task_path = path.clone();
        // Not supervised: one (de)registration, tracked and abortable; it ends with the operation.
        let abort = self.tasks.spawn(
            async move {
                // Closed only on shutdown, when the task is aborted anyway.
                let _permit = permits.acquire_owned().await;
                tracing::debug!("registration started");
                let result = operation::register(&task_path, &handlers, deadlines, &trust).await;
                Outcome { path: task_path, uuid, result: OpResult::Register(result) }
            }
            .instrument(span),
        );
        self.task_paths.insert(abort.id(), (path, uuid, Running::Register));
    }

    pub(super) fn on_joined(&mut self, joined: Result<(tokio::task::Id, Outcome), tokio::task::JoinError>) {
        let outcome = match joined {
            Ok((id, outcome)) => {
                self.task_paths.remove(&id);
                self.touched.insert(outcome.path.clone());
                outcome
            }
            Err(join_error) => {
                let Some((path, uuid, running)) = self.task_paths.remove(&join_error.id()) else { return };
                self.touched.insert(path.clone());
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

    pub(super) fn on_registered(&mut self, path: PathBuf, uuid: Uuid, Registered { info, handler }: Registered) {
        if let Some(ops) = self.ops.get_mut(&path) {
            ops.running = None;
            ops.backoff.reset();
            ops.failures = 0;
            ops.last_error = None;
            ops.rejected_by_handler = false;
        }
        // State, status and metrics first: whoever sees the log line or the
        // event can rely on them.
        self.metrics.set(World::Actual, &path, true);
        self.metrics.operation("register", true);
        self.actual.add(path.clone(), RegisteredPlugin { uuid, info: info.clone(), handler });
        self.refresh_row(&path);
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

    pub(super) fn on_register_failed(&mut self, path: PathBuf, uuid: Uuid, error: RegistrationError) {
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
            self.dirty.insert(path.clone());
            self.refresh_row(&path);
            tracing::debug!(socket = %path.display(), "plugin turned down while handlers changed; retrying now: {message}");
        } else {
            let delay = ops.backoff.fail();
            let at = Instant::now() + delay;
            ops.retry_at = Some(at);
            self.retries.push(Reverse((at, path.clone())));
            // The status first: whoever reads the log line sees it.
            self.refresh_row(&path);
            if repeated {
                tracing::debug!(socket = %path.display(), failures, retry_in = ?delay, "plugin registration failed again: {message}");
            } else {
                tracing::warn!(socket = %path.display(), failures, retry_in = ?delay, "plugin registration failed: {message}");
            }
        }
        let _ = self.events.send(PluginEvent::RegistrationFailed { socket_path: path, error: message, failures });
    }

    pub(super) fn on_deregistered(&mut self, path: PathBuf, info: PluginInfo, took: std::time::Duration) {
        if let Some(ops) = self.ops.get_mut(&path) {
            ops.running = None;
        }
        self.metrics.operation("unregister", took <= self.config.deregister_timeout);
        self.refresh_row(&path);
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
    pub(super) fn bump_epoch(&mut self) {
        self.handler_epoch += 1;
        for (path, ops) in &mut self.ops {
            if ops.rejected_by_handler && ops.retry_at.is_some() && ops.running.is_none() {
                ops.retry_at = None;
                self.dirty.insert(path.clone());
            }
        }
    }

    pub(super) fn fire_retries(&mut self) {
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
}
