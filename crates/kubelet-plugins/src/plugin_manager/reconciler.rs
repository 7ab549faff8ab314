//! The reconciler: one task that owns the desired and actual state and drives
//! every socket towards "registered if it exists, deregistered if not".
//!
//! It wakes on file-system events, on finished operations, on backoff timers
//! and on a slow periodic resync (the safety net), never on a fixed poll.
//! After each wake-up it drains whatever else is ready and reconciles only
//! the sockets those messages touched ("dirty" paths), so a burst of
//! thousands of sockets costs one pass per batch, not one full pass per
//! socket.
//!
//! Its work is split by concern: [`fs_sync`](super::fs_sync) turns what is
//! on disk into desired state, [`executor`](super::executor) runs the
//! register and deregister operations, and
//! [`status_board`](super::status_board) publishes what the outside sees
//! (status, counters) without ever asking this task.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::{Semaphore, broadcast, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::PluginManagerConfig;
use super::actual_state::ActualState;
use super::desired_state::DesiredState;
use super::executor::{Outcome, PathOps, Running};
use super::fs_sync::dir_id;
use super::metrics::Metrics;
use super::operation::HandlerMap;
use super::status::{PluginCounts, PluginEvent};
use super::status_board::StatusBoard;
use super::watcher::{EventQueue, Watcher};
use crate::health::HealthReporter;

/// Most messages handled before the dirty paths are reconciled.
const BATCH: usize = 4096;

pub(crate) struct Reconciler {
    pub(super) root: PathBuf,
    pub(super) config: PluginManagerConfig,
    pub(super) handlers: Arc<HandlerMap>,
    pub(super) desired: DesiredState,
    pub(super) actual: ActualState,
    pub(super) ops: HashMap<PathBuf, PathOps>,
    pub(super) dirty: BTreeSet<PathBuf>,
    pub(super) retries: BinaryHeap<Reverse<(Instant, PathBuf)>>,
    pub(super) tasks: JoinSet<Outcome>,
    pub(super) task_paths: HashMap<tokio::task::Id, (PathBuf, Uuid, Running)>,
    pub(super) permits: Arc<Semaphore>,
    pub(super) reported_ignored: HashSet<PathBuf>,
    pub(super) metrics: Metrics,
    pub(super) events: broadcast::Sender<PluginEvent>,
    pub(super) counts: watch::Sender<PluginCounts>,
    pub(super) failed_attempts: u64,
    pub(super) deregistrations: u64,
    /// Bumped whenever the handlers' state shrinks (a deregistration or a
    /// rolled-back registration): a plugin turned down before may fit now.
    pub(super) handler_epoch: u64,
    pub(super) watcher: Option<Watcher>,
    /// (device, inode) of the watched registration directory.
    pub(super) root_id: Option<(u64, u64)>,
    /// Paths whose status may have changed since the board was refreshed.
    pub(super) touched: BTreeSet<PathBuf>,
    /// What the handle reads, refreshed after every batch.
    pub(super) board: Arc<StatusBoard>,
    /// Failing while the registration directory cannot be watched.
    pub(super) health: HealthReporter,
}

impl Reconciler {
    pub(crate) fn new(
        config: PluginManagerConfig,
        handlers: HandlerMap,
        metrics: Metrics,
        events: broadcast::Sender<PluginEvent>,
        counts: watch::Sender<PluginCounts>,
        board: Arc<StatusBoard>,
        health: HealthReporter,
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
            touched: BTreeSet::new(),
            board,
            health,
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
    pub(crate) async fn run(mut self, mut fs: EventQueue, shutdown: CancellationToken) {
        self.rescan("start-up");
        self.settle().await;
        let period = self.config.resync_period;
        let mut resync = tokio::time::interval_at(Instant::now() + period, period);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next_retry = self.retries.peek().map(|Reverse((at, _))| *at);
            // Not biased: a stream of file events must not starve retries
            // or finished operations.
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(joined) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    self.on_joined(joined);
                }
                Some(event) = fs.recv() => self.on_fs_event(event),
                () = tokio::time::sleep_until(next_retry.unwrap_or_else(Instant::now)), if next_retry.is_some() => {
                    self.fire_retries();
                }
                _ = resync.tick() => self.rescan("periodic resync"),
            }
            self.take_ready(&mut fs);
            self.settle().await;
        }
        // Handles see the manager as closed from now on; then drain.
        self.board.close();
        drop(fs);
        self.drain().await;
        self.refresh_board();
        tracing::info!(registered = self.actual.len(), "plugin manager stopped");
    }

    /// Takes everything else that is ready before reconciling; rescans if
    /// the event queue overflowed.
    pub(super) fn take_ready(&mut self, fs: &mut EventQueue) {
        for _ in 0..BATCH {
            if let Some(joined) = self.tasks.try_join_next_with_id() {
                self.on_joined(joined);
            } else if let Some(event) = fs.try_recv() {
                self.on_fs_event(event);
            } else {
                break;
            }
        }
        // Events were dropped because the queue was full: like an inotify
        // overflow, only a full rescan can tell what changed.
        if fs.overflowed() {
            self.rescan("event queue overflow");
        }
    }

    /// Reconciles until no path is dirty, then publishes the status and
    /// counters.
    pub(super) async fn settle(&mut self) {
        while !self.dirty.is_empty() {
            self.reconcile().await;
        }
        self.refresh_board();
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
}
