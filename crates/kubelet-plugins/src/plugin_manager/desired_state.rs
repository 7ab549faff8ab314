//! The sockets that exist on disk right now, keyed by path.
//!
//! Each socket instance gets a fresh UUID. A socket that is removed and bound
//! again at the same path is a new instance (new UUID), which makes the
//! reconciler deregister the old plugin and register the new one. Seeing the
//! *same* socket again (a duplicate event, a rescan, a `chmod`) keeps its
//! UUID. A socket instance is identified by device, inode and birth time
//! (`statx`); a file system without birth times reuses inode numbers at
//! once, so there a remove event seen for the path also marks the next
//! socket found there as new ([`DesiredState::add_or_update`]'s `removed`).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use uuid::Uuid;

/// Errors of the desired state.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum DesiredStateError {
    /// An empty path cannot name a socket.
    #[error("socket path is empty")]
    EmptySocketPath,
}

/// Identity of one socket file instance on disk. The change time is not part
/// of it: `chmod`, `chown` or a relabel change it without a new socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
    born: Option<SystemTime>,
}

impl FileId {
    pub(crate) fn of(meta: &std::fs::Metadata) -> Self {
        FileId { dev: meta.dev(), ino: meta.ino(), born: meta.created().ok() }
    }
}

/// One socket the node should have registered.
#[derive(Clone, Debug)]
pub(crate) struct DesiredPlugin {
    pub(crate) uuid: Uuid,
    pub(crate) file_id: FileId,
}

/// What `add_or_update` did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// A socket appeared where none was.
    Added,
    /// A different socket now sits at the path (it was recreated).
    Replaced,
    /// The same socket was seen again.
    Unchanged,
}

/// Desired state of the world: socket path → instance.
#[derive(Debug, Default)]
pub(crate) struct DesiredState {
    plugins: BTreeMap<PathBuf, DesiredPlugin>,
}

impl DesiredState {
    /// Records the socket `file_id` at `path`. `removed` says a remove event
    /// was seen for the path since it was last looked at, so the socket there
    /// is a new instance even if it looks like the old one.
    pub(crate) fn add_or_update(
        &mut self,
        path: &Path,
        file_id: FileId,
        removed: bool,
    ) -> Result<Change, DesiredStateError> {
        if path.as_os_str().is_empty() {
            return Err(DesiredStateError::EmptySocketPath);
        }
        let fresh = || DesiredPlugin { uuid: Uuid::new_v4(), file_id };
        match self.plugins.get_mut(path) {
            Some(existing) if existing.file_id == file_id && !removed => Ok(Change::Unchanged),
            Some(existing) => {
                *existing = fresh();
                Ok(Change::Replaced)
            }
            None => {
                self.plugins.insert(path.to_path_buf(), fresh());
                Ok(Change::Added)
            }
        }
    }

    /// Removes `path` and every socket below it (it may have been a directory).
    /// Returns the removed socket paths.
    pub(crate) fn remove_tree(&mut self, path: &Path) -> Vec<PathBuf> {
        let removed = self.paths_under(path);
        for p in &removed {
            self.plugins.remove(p);
        }
        removed
    }

    /// `path` itself and every socket below it, in order.
    pub(crate) fn paths_under(&self, path: &Path) -> Vec<PathBuf> {
        self.plugins
            .range::<Path, _>((std::ops::Bound::Included(path), std::ops::Bound::Unbounded))
            .map(|(p, _)| p)
            .take_while(|p| p.starts_with(path))
            .cloned()
            .collect()
    }

    pub(crate) fn get(&self, path: &Path) -> Option<&DesiredPlugin> {
        self.plugins.get(path)
    }

    pub(crate) fn len(&self) -> usize {
        self.plugins.len()
    }

    pub(crate) fn paths(&self) -> impl Iterator<Item = &PathBuf> {
        self.plugins.keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(ino: u64, born_s: u64) -> FileId {
        FileId { dev: 1, ino, born: Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(born_s)) }
    }

    #[test]
    fn empty_socket_path_is_rejected() {
        let mut state = DesiredState::default();
        let err = state.add_or_update(Path::new(""), id(1, 1), false).expect_err("must fail");
        assert_eq!(err.to_string(), "socket path is empty");
        assert_eq!(state.len(), 0);
    }

    #[test]
    fn same_socket_seen_twice_keeps_its_uuid() {
        let mut state = DesiredState::default();
        let path = Path::new("/r/a.sock");
        assert_eq!(state.add_or_update(path, id(7, 100), false), Ok(Change::Added));
        let first = state.get(path).expect("present").uuid;
        assert_eq!(state.add_or_update(path, id(7, 100), false), Ok(Change::Unchanged));
        assert_eq!(state.get(path).expect("present").uuid, first);
    }

    #[test]
    fn recreated_socket_gets_a_new_uuid_even_with_a_reused_inode() {
        let mut state = DesiredState::default();
        let path = Path::new("/r/a.sock");
        state.add_or_update(path, id(7, 100), false).expect("add");
        let first = state.get(path).expect("present").uuid;
        assert_eq!(state.add_or_update(path, id(7, 200), false), Ok(Change::Replaced), "new birth time");
        let second = state.get(path).expect("present").uuid;
        assert_ne!(second, first);
        assert_eq!(state.add_or_update(path, id(7, 200), true), Ok(Change::Replaced), "a remove was seen");
        assert_ne!(state.get(path).expect("present").uuid, second);
    }

    #[test]
    fn chmod_keeps_the_socket_instance() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let before = FileId::of(&std::fs::metadata(&path).expect("stat"));
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
        let after = FileId::of(&std::fs::metadata(&path).expect("stat"));
        assert_eq!(before, after);
    }

    #[test]
    fn removing_a_directory_removes_only_sockets_below_it() {
        let mut state = DesiredState::default();
        for (i, p) in ["/r/a/x.sock", "/r/a/b/y.sock", "/r/a-b.sock", "/r/ab.sock", "/r/a.sock"].into_iter().enumerate()
        {
            state.add_or_update(Path::new(p), id(i as u64, 0), false).expect("add");
        }
        let removed = state.remove_tree(Path::new("/r/a"));
        assert_eq!(removed, vec![PathBuf::from("/r/a/b/y.sock"), PathBuf::from("/r/a/x.sock")]);
        let left: Vec<_> = state.paths().cloned().collect();
        assert_eq!(left, vec![PathBuf::from("/r/a-b.sock"), PathBuf::from("/r/a.sock"), PathBuf::from("/r/ab.sock")]);
    }
}
