//! The node's one inotify instance for log follows.

use std::path::Path as FsPath;

use inotify::{Inotify, WatchDescriptor, WatchMask};
use tokio_stream::StreamExt as _;

/// The node's one inotify instance for log follows, made at the first
/// follow: a watch per log directory followed, shared by its followers
/// (counted), removed when the last one goes. Cheap to clone.
#[derive(Clone)]
pub(crate) struct LogWatcher {
    inner: std::sync::Arc<std::sync::Mutex<WatcherState>>,
    shutdown: tokio_util::sync::CancellationToken,
}

#[derive(Default)]
struct WatcherState {
    /// The instance's watch handle, once made.
    watches: Option<inotify::Watches>,
    /// Per watched directory: its wake-up signal and how many follow it.
    dirs: std::collections::HashMap<WatchDescriptor, (tokio::sync::watch::Sender<u64>, usize)>,
    /// inotify instances made (one, unless making it failed).
    instances: usize,
}

/// One follower's interest in a directory: woken (its counter changes)
/// by every change in it; the watch goes with the last subscription.
pub(crate) struct LogSubscription {
    pub(crate) changes: tokio::sync::watch::Receiver<u64>,
    wd: WatchDescriptor,
    watcher: LogWatcher,
}

impl Drop for LogSubscription {
    fn drop(&mut self) {
        let mut state = self.watcher.lock();
        let last = match state.dirs.get_mut(&self.wd) {
            Some((_, followers)) => {
                *followers -= 1;
                *followers == 0
            }
            None => false,
        };
        if last {
            state.dirs.remove(&self.wd);
            if let Some(watches) = state.watches.as_mut() {
                // Gone already if the directory was removed.
                let _ = watches.remove(self.wd.clone());
            }
        }
    }
}

impl LogWatcher {
    pub(crate) fn new(shutdown: tokio_util::sync::CancellationToken) -> Self {
        LogWatcher { inner: std::sync::Arc::default(), shutdown }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatcherState> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Watches `dir` (creations, writes and renames into it) for one
    /// follower.
    pub(crate) fn subscribe(&self, dir: &FsPath) -> std::io::Result<LogSubscription> {
        let mut state = self.lock();
        if state.watches.is_none() {
            let stream = Inotify::init()?.into_event_stream(vec![0u8; 4096])?;
            state.watches = Some(stream.watches());
            state.instances += 1;
            let (inner, shutdown) = (std::sync::Arc::downgrade(&self.inner), self.shutdown.clone());
            // Not supervised: one inotify instance's reader; it ends when no log is followed.
            tokio::spawn(Self::deliver(stream, inner, shutdown));
        }
        let watches = state.watches.as_mut().ok_or_else(|| std::io::Error::other("no log watcher"))?;
        let wd = watches.add(dir, WatchMask::MODIFY | WatchMask::CREATE | WatchMask::MOVED_TO)?;
        let (sender, followers) = state.dirs.entry(wd.clone()).or_insert_with(|| (tokio::sync::watch::channel(0).0, 0));
        *followers += 1;
        let changes = sender.subscribe();
        Ok(LogSubscription { changes, wd, watcher: self.clone() })
    }

    /// Wakes the followers of each directory an event names (all of them
    /// when the kernel's queue overflowed), until the node stops.
    async fn deliver(
        mut stream: inotify::EventStream<Vec<u8>>,
        state: std::sync::Weak<std::sync::Mutex<WatcherState>>,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = stream.next() => event,
            };
            let Some(Ok(event)) = event else {
                tracing::warn!("the log watcher ended; log follows end with it");
                if let Some(state) = state.upgrade() {
                    let mut state = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    // Dropping the senders ends every follower's wait.
                    state.dirs.clear();
                    state.watches = None;
                }
                return;
            };
            let Some(state) = state.upgrade() else { return };
            let state = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if event.mask.contains(inotify::EventMask::Q_OVERFLOW) {
                for (sender, _) in state.dirs.values() {
                    sender.send_modify(|n| *n += 1);
                }
            } else if let Some((sender, _)) = state.dirs.get(&event.wd) {
                sender.send_modify(|n| *n += 1);
            }
        }
    }

    /// (inotify instances made, directories watched now).
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let state = self.lock();
        (state.instances, state.dirs.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Followers share the node's one inotify instance: one watch per
    /// directory however many follow it, removed with the last of them;
    /// each follower is woken by a write.
    #[tokio::test]
    async fn followers_share_one_watcher() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a).expect("mkdir");
        std::fs::create_dir_all(&b).expect("mkdir");
        let watcher = LogWatcher::new(tokio_util::sync::CancellationToken::new());
        let mut first = watcher.subscribe(&a).expect("subscribe");
        let mut second = watcher.subscribe(&a).expect("subscribe");
        let third = watcher.subscribe(&b).expect("subscribe");
        assert_eq!(watcher.counts(), (1, 2), "one instance, a watch per directory");
        std::fs::write(a.join("0.log"), "x").expect("write");
        for follower in [&mut first, &mut second] {
            tokio::time::timeout(std::time::Duration::from_secs(30), follower.changes.changed())
                .await
                .expect("woken in time")
                .expect("watcher alive");
        }
        drop(first);
        assert_eq!(watcher.counts(), (1, 2), "a is still followed");
        drop(second);
        assert_eq!(watcher.counts(), (1, 1), "a's watch went with its last follower");
        drop(third);
        assert_eq!(watcher.counts(), (1, 0));
    }
}
