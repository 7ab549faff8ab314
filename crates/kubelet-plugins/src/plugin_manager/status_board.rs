//! What the outside world reads of the plugin manager: the per-socket status
//! board and the counters.
//!
//! The reconciler refreshes the board after every batch, only for the paths
//! the batch touched, so reading it never waits on the reconciler (which may
//! be waiting for slow deregistrations) and a refresh costs what the batch
//! changed, not the number of plugins.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::executor::Running;
use super::handler::PluginInfo;
use super::reconciler::Reconciler;
use super::status::{PluginCounts, PluginState, PluginStatus};

/// One socket's row, as of the last refresh.
#[derive(Clone, Debug)]
struct Row {
    state: PluginState,
    plugin: Option<PluginInfo>,
    failures: u32,
    last_error: Option<String>,
    retry_at: Option<Instant>,
}

/// The status of every socket, shared by the reconciler (writer) and the
/// handles (readers).
#[derive(Debug, Default)]
pub(crate) struct StatusBoard {
    rows: Mutex<BTreeMap<PathBuf, Row>>,
    closed: CancellationToken,
}

impl StatusBoard {
    fn rows(&self) -> std::sync::MutexGuard<'_, BTreeMap<PathBuf, Row>> {
        // Writers replace whole rows; a poisoned lock still holds whole rows.
        self.rows.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every socket's status, sorted by path.
    pub(crate) fn snapshot(&self) -> Vec<PluginStatus> {
        let now = Instant::now();
        self.rows()
            .iter()
            .map(|(path, row)| PluginStatus {
                socket_path: path.clone(),
                state: row.state.clone(),
                plugin: row.plugin.clone(),
                failures: row.failures,
                last_error: row.last_error.clone(),
                retry_in_ms: row.retry_at.map(|at| at.saturating_duration_since(now).as_millis() as u64),
            })
            .collect()
    }

    /// The manager has begun shutting down.
    pub(crate) fn close(&self) {
        self.closed.cancel();
    }

    /// Resolves once the manager has begun shutting down.
    pub(crate) async fn closed(&self) {
        self.closed.cancelled().await;
    }
}

impl Reconciler {
    /// Rewrites the board's rows of the paths touched since the last refresh.
    pub(super) fn refresh_board(&mut self) {
        if self.touched.is_empty() {
            return;
        }
        let touched = std::mem::take(&mut self.touched);
        let updates: Vec<(PathBuf, Option<Row>)> = touched
            .into_iter()
            .map(|path| {
                let row = self.row(&path);
                (path, row)
            })
            .collect();
        let mut rows = self.board.rows();
        for (path, row) in updates {
            match row {
                Some(row) => rows.insert(path, row),
                None => rows.remove(&path),
            };
        }
    }

    /// Rewrites the row of `path` now: before an event about it is sent, so
    /// whoever sees the event reads a status that agrees with it.
    pub(super) fn refresh_row(&self, path: &PathBuf) {
        let row = self.row(path);
        let mut rows = self.board.rows();
        match row {
            Some(row) => rows.insert(path.clone(), row),
            None => rows.remove(path),
        };
    }

    /// The row of `path`, or `None` when the manager knows nothing of it.
    fn row(&self, path: &PathBuf) -> Option<Row> {
        let registered = self.actual.get(path);
        if registered.is_none() && self.desired.get(path).is_none() {
            return None;
        }
        let ops = self.ops.get(path);
        let state = match (ops.and_then(|o| o.running), registered) {
            (Some(Running::Register), _) => PluginState::Registering,
            (Some(Running::Deregister), _) => PluginState::Deregistering,
            (None, Some(_)) => PluginState::Registered,
            (None, None) if ops.is_some_and(|o| o.retry_at.is_some()) => PluginState::BackingOff,
            (None, None) => PluginState::Pending,
        };
        Some(Row {
            state,
            plugin: registered.map(|r| r.info.clone()),
            failures: ops.map_or(0, |o| o.failures),
            last_error: ops.and_then(|o| o.last_error.clone()),
            retry_at: ops.and_then(|o| o.retry_at),
        })
    }

    pub(super) fn publish_counts(&self) {
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
}
