//! Finds plugin sockets under the registration directory.
//!
//! inotify says *that* something changed at a path; it
//! does not say reliably *what*: a rename away is a single event on the
//! directory, and a full kernel queue drops events.
//!
//! Directories are watched one by one, each *before* it is read, so a
//! socket created in it is either seen by the read or reported by the watch
//! (a recursive watch that reports a new directory before watching it would
//! miss a socket bound in that gap: `mkdir -p a/b` then `bind`). The inotify
//! descriptor is read by a task on the node's own runtime (no watcher thread
//! in between), so an event reaches the reconciler with one wake-up. The
//! watcher forwards only "look at
//! this path again" ([`FsEvent::Changed`]) or "look at everything again"
//! ([`FsEvent::Rescan`]), and [`scan`] decides what is on disk now by `lstat`
//! and directory walks. Every event kind — create, remove, rename in or out —
//! thus ends in the same question, answered from the file system itself.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::sync::Mutex;

use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;

use super::desired_state::FileId;

/// Errors that stop the watcher from starting.
#[derive(Debug, thiserror::Error)]
pub enum WatcherError {
    /// Something other than a directory is at the registration path.
    #[error("plugin registration path {path} exists but is not a directory")]
    NotADirectory {
        /// The registration path.
        path: PathBuf,
    },
    /// The registration directory could not be created.
    #[error("cannot create plugin registration directory {path}: {source}")]
    Create {
        /// The registration path.
        path: PathBuf,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// The registration directory cannot be written to (plugins could not
    /// create their sockets in it either).
    #[error("plugin registration directory {path} is not writable: {source}")]
    NotWritable {
        /// The registration path.
        path: PathBuf,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// inotify refused the watch (for example `max_user_watches` reached).
    #[error("cannot watch plugin registration directory {path}: {source}")]
    Watch {
        /// The registration path.
        path: PathBuf,
        /// What inotify reported.
        #[source]
        source: io::Error,
    },
}

/// What the file system told us, reduced to what the reconciler must re-check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FsEvent {
    /// Something happened at this path (or below it): look again. `removed`
    /// says what was there was removed or renamed away, so whatever is found
    /// there now is a new instance.
    Changed {
        /// The path.
        path: PathBuf,
        /// A remove or rename-away event.
        removed: bool,
    },
    /// Events may have been lost: look at the whole tree again.
    Rescan(&'static str),
}

/// Makes the bounded queue that carries events from inotify's thread to the
/// reconciler. When it is full, events are dropped and the overflow noted:
/// the reconciler then rescans, as after an inotify queue overflow, so a
/// flood of events costs bounded memory and loses nothing.
pub(crate) fn event_queue(capacity: usize) -> (EventSender, EventQueue) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let overflow = Arc::new(AtomicBool::new(false));
    (EventSender { tx, overflow: overflow.clone() }, EventQueue { rx, overflow })
}

/// The inotify side of the event queue.
#[derive(Clone)]
pub(crate) struct EventSender {
    tx: mpsc::Sender<FsEvent>,
    overflow: Arc<AtomicBool>,
}

impl EventSender {
    /// Queues `event`, or notes the overflow when the queue is full. Never blocks.
    pub(crate) fn send(&self, event: FsEvent) {
        match self.tx.try_send(event) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                if !self.overflow.swap(true, Ordering::AcqRel) {
                    tracing::warn!("plugin watcher event queue full; dropping events and rescanning");
                }
            }
            // The manager stopped.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }
}

/// The reconciler side of the event queue.
pub(crate) struct EventQueue {
    rx: mpsc::Receiver<FsEvent>,
    overflow: Arc<AtomicBool>,
}

impl EventQueue {
    /// The next event; `None` once the watcher is gone.
    pub(crate) async fn recv(&mut self) -> Option<FsEvent> {
        self.rx.recv().await
    }

    /// The next event if one is ready.
    pub(crate) fn try_recv(&mut self) -> Option<FsEvent> {
        self.rx.try_recv().ok()
    }

    /// Whether events were dropped since the last call (clears the note).
    pub(crate) fn overflowed(&self) -> bool {
        self.overflow.swap(false, Ordering::AcqRel)
    }
}

/// Directories by watch descriptor, shared by the watcher (which adds and
/// removes watches) and the task that reads the events.
type WatchedDirs = Arc<Mutex<HashMap<WatchDescriptor, PathBuf>>>;

fn lock(dirs: &WatchedDirs) -> std::sync::MutexGuard<'_, HashMap<WatchDescriptor, PathBuf>> {
    // Only inserts and removes under the lock: a poisoned map is still whole.
    dirs.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a watched directory reports: entries created, deleted or renamed in
/// or out, and the directory's own deletion or move. Symlinks are not
/// followed.
fn dir_mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::DELETE_SELF
        | WatchMask::MOVE_SELF
        | WatchMask::ONLYDIR
        | WatchMask::DONT_FOLLOW
}

/// Keeps the inotify watches alive; dropping it stops the events.
pub(crate) struct Watcher {
    watches: Watches,
    /// Watched directories at and below the root.
    dirs: BTreeMap<PathBuf, WatchDescriptor>,
    by_descriptor: WatchedDirs,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Watcher {
    fn add(&mut self, dir: &Path) -> io::Result<()> {
        let wd = self.watches.add(dir, dir_mask())?;
        lock(&self.by_descriptor).insert(wd.clone(), dir.to_path_buf());
        self.dirs.insert(dir.to_path_buf(), wd);
        Ok(())
    }

    /// Watches `root` again after it was deleted and created anew (a watch
    /// dies with the directory it watched); its subdirectories are watched
    /// again as the rescan reaches them.
    pub(crate) fn rewatch(&mut self, root: &Path) -> Result<(), WatcherError> {
        for (_, wd) in std::mem::take(&mut self.dirs) {
            // Most died with their directories already.
            let _ = self.watches.remove(wd.clone());
            lock(&self.by_descriptor).remove(&wd);
        }
        self.add(root).map_err(|source| WatcherError::Watch { path: root.to_path_buf(), source })
    }

    /// Watches directory `dir` (not recursively) unless it already is.
    pub(crate) fn watch_dir(&mut self, dir: &Path) {
        if self.dirs.contains_key(dir) {
            return;
        }
        match self.add(dir) {
            Ok(()) => {}
            // Gone already (or replaced by something else): nothing to watch.
            // Anything else (the watch limit) is worth a warning: sockets
            // below it would be missed until the next resync.
            Err(error) if is_gone(&error) => {}
            Err(error) => {
                tracing::warn!(%error, dir = %dir.display(), "cannot watch directory in plugin registration directory")
            }
        }
    }

    /// Forgets the watches of `path` and the directories below it.
    pub(crate) fn unwatch_tree(&mut self, path: &Path) {
        let below: Vec<PathBuf> = self
            .dirs
            .range(path.to_path_buf()..)
            .take_while(|(d, _)| d.starts_with(path))
            .map(|(d, _)| d.clone())
            .collect();
        for dir in below {
            if let Some(wd) = self.dirs.remove(&dir) {
                let _ = self.watches.remove(wd.clone());
                lock(&self.by_descriptor).remove(&wd);
            }
        }
    }
}

/// Creates the registration directory (0755) if missing and checks that it is
/// a writable directory.
pub(crate) fn prepare_dir(root: &Path) -> Result<(), WatcherError> {
    match std::fs::metadata(root) {
        Ok(meta) if !meta.is_dir() => {
            return Err(WatcherError::NotADirectory { path: root.to_path_buf() });
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Err(source) = std::fs::create_dir_all(root)
                .and_then(|()| std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)))
            {
                // Something appeared at the path between the look and the
                // create: report what it is, not the create's EEXIST.
                let appeared_not_dir = std::fs::symlink_metadata(root).is_ok_and(|meta| !meta.is_dir());
                if source.kind() == io::ErrorKind::AlreadyExists && appeared_not_dir {
                    return Err(WatcherError::NotADirectory { path: root.to_path_buf() });
                }
                return Err(WatcherError::Create { path: root.to_path_buf(), source });
            }
        }
        Err(source) => return Err(WatcherError::Create { path: root.to_path_buf(), source }),
    }
    // A hidden probe file: the watcher ignores names starting with '.'.
    let probe = root.join(format!(".rustlet-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").and_then(|()| std::fs::remove_file(&probe)).map_err(|source| {
        // The directory may have been replaced since it was checked.
        if std::fs::symlink_metadata(root).is_ok_and(|meta| !meta.is_dir()) {
            WatcherError::NotADirectory { path: root.to_path_buf() }
        } else {
            WatcherError::NotWritable { path: root.to_path_buf(), source }
        }
    })
}

/// Starts watching `root` (subdirectories are added as they are read) and
/// its parent, and spawns the task that reads the events into `tx`. Must be
/// called inside a Tokio runtime.
pub(crate) fn start(root: &Path, tx: EventSender) -> Result<Watcher, WatcherError> {
    let watch_error = |source| WatcherError::Watch { path: root.to_path_buf(), source };
    let inotify = Inotify::init().map_err(watch_error)?;
    let stream = inotify.into_event_stream(vec![0u8; 64 * 1024]).map_err(watch_error)?;
    let watches = stream.watches();
    let by_descriptor: WatchedDirs = Arc::default();
    let span = tracing::info_span!("plugin_watcher", dir = %root.display());
    // Not supervised: its end closes the event channel, which ends the plugin manager's task (watched).
    let reader = tokio::spawn(tracing::Instrument::instrument(read_events(stream, by_descriptor.clone(), tx), span));
    let mut watcher = Watcher { watches, dirs: BTreeMap::new(), by_descriptor, reader };
    watcher.add(root).map_err(watch_error)?;
    // The parent, for the root's own entry: a watch cannot reliably report
    // the deletion of its own directory, but the parent's watch reports the
    // directory's removal and re-creation as events on the root path.
    if let Some(parent) = root.parent() {
        match watcher.watches.add(parent, dir_mask()) {
            Ok(wd) => {
                lock(&watcher.by_descriptor).insert(wd, parent.to_path_buf());
            }
            Err(error) => {
                tracing::debug!(%error, parent = %parent.display(), "cannot watch the registration directory's parent")
            }
        }
    }
    Ok(watcher)
}

/// Reads inotify events until the watcher is dropped (which aborts this
/// task), turning each into what the reconciler must look at again.
async fn read_events(mut stream: inotify::EventStream<Vec<u8>>, dirs: WatchedDirs, tx: EventSender) {
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                if event.mask.contains(EventMask::IGNORED) {
                    // The watch is gone (its directory was deleted).
                    lock(&dirs).remove(&event.wd);
                    continue;
                }
                let dir = lock(&dirs).get(&event.wd).cloned();
                for change in translate(dir.as_deref(), event.mask, event.name.as_deref()) {
                    tx.send(change);
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot read file events; rescanning the plugin registration directory");
                tx.send(FsEvent::Rescan("watch error"));
                if !matches!(error.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) {
                    tracing::error!("plugin watcher stopped reading events; the periodic resync still finds sockets");
                    return;
                }
            }
        }
    }
}

/// Reduces one inotify event, in directory `dir` (`None`: a watch no longer
/// known), to what the reconciler must look at again.
pub(crate) fn translate(dir: Option<&Path>, mask: EventMask, name: Option<&OsStr>) -> Vec<FsEvent> {
    if mask.contains(EventMask::Q_OVERFLOW) {
        tracing::warn!("inotify queue overflow; rescanning the plugin registration directory");
        return vec![FsEvent::Rescan("inotify queue overflow")];
    }
    let Some(dir) = dir else { return Vec::new() };
    let removed =
        mask.intersects(EventMask::DELETE | EventMask::MOVED_FROM | EventMask::DELETE_SELF | EventMask::MOVE_SELF);
    let path = match name {
        Some(name) if !name.is_empty() => dir.join(name),
        // An event on the directory itself.
        _ => dir.to_path_buf(),
    };
    vec![FsEvent::Changed { path, removed }]
}

/// What sits at a path, as far as plugin registration cares.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Entry {
    /// A Unix socket: a plugin candidate.
    Socket(FileId),
    /// A directory: walk it.
    Directory,
    /// Something that is not a plugin (regular file, FIFO, symlink, hidden name).
    Ignored(&'static str),
    /// Nothing is there (any more).
    Missing,
    /// The path could not be examined (permissions, too many open files):
    /// what was known about it stays as it was.
    Unreadable(io::ErrorKind),
}

/// True when any component of `path` below `root` starts with `.`.
pub(crate) fn is_hidden(root: &Path, path: &Path) -> bool {
    path.strip_prefix(root).is_ok_and(|rel| {
        rel.components().any(|c| matches!(c, Component::Normal(name) if name.as_encoded_bytes().first() == Some(&b'.')))
    })
}

/// Looks at `path` without following symlinks.
pub(crate) fn classify(root: &Path, path: &Path) -> Entry {
    if is_hidden(root, path) {
        return Entry::Ignored("hidden name");
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if is_gone(&e) => Entry::Missing,
        Err(e) => Entry::Unreadable(e.kind()),
        Ok(meta) => {
            let ft = meta.file_type();
            if ft.is_socket() {
                Entry::Socket(FileId::of(&meta))
            } else if ft.is_dir() {
                Entry::Directory
            } else if ft.is_symlink() {
                Entry::Ignored("symbolic link (not followed)")
            } else if ft.is_fifo() {
                Entry::Ignored("FIFO, not a socket")
            } else if ft.is_file() {
                Entry::Ignored("regular file, not a socket")
            } else {
                Entry::Ignored("not a socket")
            }
        }
    }
}

/// Errors that mean "nothing is at this path".
fn is_gone(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory)
}

/// The result of walking a directory tree.
#[derive(Debug, Default)]
pub(crate) struct Scan {
    /// Every socket found, with its identity.
    pub(crate) sockets: Vec<(PathBuf, FileId)>,
    /// Entries that look like plugins but are not (name ends in `.sock`).
    pub(crate) ignored: Vec<(PathBuf, &'static str)>,
    /// Paths (files or whole subtrees) that could not be read: what is known
    /// below them must be kept, not forgotten.
    pub(crate) unreadable: Vec<(PathBuf, io::ErrorKind)>,
}

impl Scan {
    /// True when `path` is at or below a path that could not be read.
    pub(crate) fn is_unknown(&self, path: &Path) -> bool {
        self.unreadable.iter().any(|(p, _)| path.starts_with(p))
    }
}

/// Walks `dir` recursively (not following symlinks, skipping hidden names),
/// calling `before_reading` on each directory before its entries are read.
pub(crate) fn scan(root: &Path, dir: &Path, before_reading: &mut dyn FnMut(&Path)) -> Scan {
    let mut out = Scan::default();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(current) = stack.pop() {
        before_reading(&current);
        let entries = match std::fs::read_dir(&current) {
            Ok(entries) => entries,
            Err(e) if is_gone(&e) => continue,
            Err(e) => {
                out.unreadable.push((current, e.kind()));
                continue;
            }
        };
        for entry in entries {
            let path = match entry {
                Ok(entry) => entry.path(),
                Err(e) => {
                    // The directory's listing broke off: its rest is unknown.
                    out.unreadable.push((current.clone(), e.kind()));
                    break;
                }
            };
            match classify(root, &path) {
                Entry::Socket(id) => out.sockets.push((path, id)),
                Entry::Directory => stack.push(path),
                Entry::Ignored(why) if looks_like_socket(&path) => out.ignored.push((path, why)),
                Entry::Unreadable(kind) => out.unreadable.push((path, kind)),
                Entry::Ignored(_) | Entry::Missing => {}
            }
        }
    }
    out
}

/// Names that a user probably meant as a plugin socket, worth a log line when
/// they are ignored.
pub(crate) fn looks_like_socket(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "sock")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_become_paths_to_look_at_and_overflow_a_rescan() {
        let dir = Some(Path::new("/r"));
        let name = Some(OsStr::new("a.sock"));
        assert_eq!(translate(dir, EventMask::Q_OVERFLOW, None), vec![FsEvent::Rescan("inotify queue overflow")]);
        assert_eq!(translate(None, EventMask::CREATE, name), Vec::new(), "a watch no longer known");
        let at = |removed| vec![FsEvent::Changed { path: "/r/a.sock".into(), removed }];
        assert_eq!(translate(dir, EventMask::CREATE, name), at(false));
        assert_eq!(translate(dir, EventMask::MOVED_TO, name), at(false));
        assert_eq!(translate(dir, EventMask::DELETE, name), at(true));
        assert_eq!(translate(dir, EventMask::MOVED_FROM, name), at(true));
        assert_eq!(
            translate(dir, EventMask::DELETE_SELF, None),
            vec![FsEvent::Changed { path: "/r".into(), removed: true }],
            "the directory itself"
        );
    }

    /// The real inotify, read on the runtime: a socket bound in a watched
    /// directory is reported, and so is a directory made in it.
    #[tokio::test]
    async fn the_watch_reports_sockets_and_directories() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("plugins_registry");
        prepare_dir(&root).expect("prepare");
        let (tx, mut queue) = event_queue(64);
        let _watcher = start(&root, tx).expect("watch");
        let _socket = std::os::unix::net::UnixListener::bind(root.join("a.sock")).expect("bind");
        std::fs::create_dir(root.join("sub")).expect("mkdir");
        let mut seen = Vec::new();
        while seen.len() < 2 {
            let event = tokio::time::timeout(std::time::Duration::from_secs(20), queue.recv())
                .await
                .expect("in time")
                .expect("open");
            seen.push(event);
        }
        assert_eq!(
            seen,
            vec![
                FsEvent::Changed { path: root.join("a.sock"), removed: false },
                FsEvent::Changed { path: root.join("sub"), removed: false }
            ]
        );
    }

    #[test]
    fn hidden_components_below_root_are_detected() {
        let root = Path::new("/r/.x");
        assert!(!is_hidden(root, Path::new("/r/.x/a/b.sock")), "the root's own name does not count");
        assert!(is_hidden(root, Path::new("/r/.x/.a/b.sock")));
        assert!(is_hidden(root, Path::new("/r/.x/a/.b.sock")));
    }

    #[test]
    fn classify_tells_non_sockets_apart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let file = root.join("file.sock");
        std::fs::write(&file, b"x").expect("write");
        let link = root.join("link.sock");
        std::os::unix::fs::symlink(&file, &link).expect("symlink");
        let sock = root.join("real.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
        assert_eq!(classify(root, &file), Entry::Ignored("regular file, not a socket"));
        assert_eq!(classify(root, &link), Entry::Ignored("symbolic link (not followed)"));
        assert!(matches!(classify(root, &sock), Entry::Socket(_)));
        assert_eq!(classify(root, &root.join("absent.sock")), Entry::Missing);
        assert_eq!(classify(root, root), Entry::Directory);
    }

    #[test]
    fn scan_finds_nested_sockets_and_reports_impostors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        std::fs::create_dir_all(root.join("a/b")).expect("mkdir");
        std::fs::create_dir_all(root.join(".hidden")).expect("mkdir");
        let _l1 = std::os::unix::net::UnixListener::bind(root.join("a/b/p.sock")).expect("bind");
        let _l2 = std::os::unix::net::UnixListener::bind(root.join("top.sock")).expect("bind");
        let _l3 = std::os::unix::net::UnixListener::bind(root.join(".hidden/h.sock")).expect("bind");
        std::fs::write(root.join("a/fake.sock"), b"").expect("write");
        let mut read = Vec::new();
        let found = scan(root, root, &mut |d| read.push(d.to_path_buf()));
        read.sort();
        assert_eq!(read, vec![root.to_path_buf(), root.join("a"), root.join("a/b")], "hidden directories are not read");
        let mut sockets: Vec<_> = found.sockets.into_iter().map(|(p, _)| p).collect();
        sockets.sort();
        assert_eq!(sockets, vec![root.join("a/b/p.sock"), root.join("top.sock")]);
        assert_eq!(found.ignored, vec![(root.join("a/fake.sock"), "regular file, not a socket")]);
    }

    #[test]
    fn a_file_in_place_of_the_directory_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("plugins_registry");
        std::fs::write(&path, b"").expect("write");
        let err = prepare_dir(&path).expect_err("must fail");
        assert!(err.to_string().contains("is not a directory"), "{err}");
    }

    #[test]
    fn a_missing_directory_is_created_0755() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x/plugins_registry");
        prepare_dir(&path).expect("prepare");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o755);
    }
}
