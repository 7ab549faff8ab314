//! Filesystem sync: what is on disk under the registration directory
//! becomes the desired state.
//!
//! Every event ends in the same question, "what is at this path now?",
//! answered by `lstat` and directory walks ([`watcher::classify`],
//! [`watcher::scan`]); a rescan walks the whole tree. Paths whose desired
//! state changed are marked dirty for the executor.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::desired_state::{Change, FileId};
use super::metrics::World;
use super::reconciler::Reconciler;
use super::watcher::{self, Entry, FsEvent};

impl Reconciler {
    pub(super) fn on_fs_event(&mut self, event: FsEvent) {
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
    pub(super) fn look_at(&mut self, path: &Path, removed: bool) {
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

    pub(super) fn report_ignored(&mut self, path: PathBuf, why: &'static str) {
        if watcher::looks_like_socket(&path) && !self.reported_ignored.contains(&path) {
            tracing::info!(path = %path.display(), reason = why, "ignoring entry in plugin registration directory");
            self.reported_ignored.insert(path);
        }
    }

    pub(super) fn rescan(&mut self, reason: &'static str) {
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
    pub(super) fn check_root(&mut self) {
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
            Ok(()) => {
                self.root_id = dir_id(&self.root);
                self.health.healthy();
                tracing::info!(dir = %self.root.display(), "watching the plugin registration directory");
            }
            Err(error) => {
                // Health first: whoever reads the log line sees the check failing.
                self.health.failing(format!("{error}; retrying at the next resync"));
                tracing::error!(%error, "cannot watch the plugin registration directory; retrying at the next resync");
            }
        }
    }

    /// Walks the directory `dir`: sockets found are desired, desired sockets
    /// below it that are gone are forgotten (unless the walk could not see
    /// them).
    pub(super) fn sync_tree(&mut self, dir: &Path) {
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

    pub(super) fn desire(&mut self, path: &Path, id: FileId, removed: bool) {
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
    pub(super) fn forget_tree(&mut self, path: &Path) {
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
    pub(super) fn forget_below(&mut self, path: &Path) {
        let below: Vec<PathBuf> = self.desired.paths_under(path).into_iter().filter(|p| p != path).collect();
        for p in below {
            self.forget_tree(&p);
        }
    }
}

/// (device, inode) of the directory at `path`, if it is one.
pub(super) fn dir_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().filter(|m| m.is_dir()).map(|m| (m.dev(), m.ino()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::{broadcast, watch};

    use super::super::PluginManagerConfig;
    use super::super::metrics::Metrics;
    use super::super::operation::HandlerMap;
    use super::super::status::PluginCounts;
    use super::super::status_board::StatusBoard;
    use super::*;

    fn reconciler(dir: &Path) -> Reconciler {
        let (events, _) = broadcast::channel(16);
        let (counts, _) = watch::channel(PluginCounts::default());
        let board = Arc::new(StatusBoard::default());
        let health = crate::health::HealthReporter::new();
        Reconciler::new(
            PluginManagerConfig::new(dir),
            HandlerMap::new(),
            Metrics::default(),
            events,
            counts,
            board,
            health,
        )
    }

    /// Bad input: more events than the queue holds. The ones that did not
    /// fit are dropped, and the overflow makes the reconciler rescan, so the
    /// sockets they were about are found all the same.
    #[tokio::test]
    async fn events_dropped_by_a_full_queue_are_made_up_by_a_rescan() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let mut r = reconciler(root);
        let (tx, mut queue) = watcher::event_queue(1);
        let mut sockets = Vec::new();
        for name in ["a.sock", "b.sock", "c.sock"] {
            sockets.push(std::os::unix::net::UnixListener::bind(root.join(name)).expect("bind"));
            tx.send(FsEvent::Changed { path: root.join(name), removed: false });
        }
        r.take_ready(&mut queue);
        assert_eq!(r.desired.len(), 3, "the two dropped events' sockets are found by the rescan");
        assert!(!queue.overflowed(), "the overflow note is cleared once handled");
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
