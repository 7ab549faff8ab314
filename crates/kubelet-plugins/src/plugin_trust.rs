//! Which processes may offer the node a plugin.
//!
//! Beyond upstream (which trusts anything that can write a socket into
//! `plugins_registry/` or reach `kubelet.sock`): a plugin socket found in
//! the registration directory, and a `Register` call on `kubelet.sock`,
//! are accepted only from a process running as root or as a user named in
//! the allow-list (`--plugin-allowed-uids`). Its credentials are read with
//! `SO_PEERCRED` on the very connection used. The socket file it serves
//! must be owned by that process's user and writable by no one else, so
//! that another user cannot put a socket of theirs in its place.

use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::Path;
use std::sync::Arc;

use kubelet_api::uds::PeerCredentials;

/// Why a plugin is not trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TrustError {
    /// The plugin's process runs as a user that may not offer plugins.
    #[error(
        "the plugin process (pid {pid}) runs as uid {uid}, which is neither root nor in --plugin-allowed-uids ({allowed})",
        pid = pid.map_or_else(|| "unknown".to_owned(), |p| p.to_string())
    )]
    User {
        /// The process's user.
        uid: u32,
        /// The process, if the kernel said.
        pid: Option<i32>,
        /// The allow-list, comma-separated (`empty` when it is).
        allowed: String,
    },
    /// The socket file's owner cannot be read.
    #[error("cannot read the socket file's owner: {0}")]
    Unreadable(String),
    /// The path is not a socket.
    #[error("the path is not a socket file")]
    NotASocket,
    /// The socket file belongs to another user than its server's.
    #[error("the socket file is owned by uid {owner}, not by the plugin process's user (uid {uid})")]
    Owner {
        /// The file's owner.
        owner: u32,
        /// The serving process's user.
        uid: u32,
    },
    /// Users other than the owner may connect in its place.
    #[error(
        "the socket file's mode {mode:04o} lets users other than its owner write to it (connect); make it 0755 or stricter"
    )]
    Mode {
        /// The file's permission bits.
        mode: u32,
    },
}

/// The allow-list: root always, and these user IDs.
#[derive(Clone, Debug, Default)]
pub struct PluginTrust {
    allowed_uids: Arc<[u32]>,
}

impl PluginTrust {
    /// Root, and `allowed_uids`.
    pub fn new(allowed_uids: impl IntoIterator<Item = u32>) -> Self {
        PluginTrust { allowed_uids: allowed_uids.into_iter().collect() }
    }

    /// Whether a process of `peer`'s user may offer a plugin.
    pub(crate) fn check_peer(&self, peer: PeerCredentials) -> Result<(), TrustError> {
        if peer.uid == 0 || self.allowed_uids.contains(&peer.uid) {
            return Ok(());
        }
        Err(TrustError::User { uid: peer.uid, pid: peer.pid, allowed: self.allowed_list() })
    }

    /// Whether the socket file at `socket`, served by `peer`, may be
    /// trusted: the peer is allowed ([`PluginTrust::check_peer`]), the file
    /// is a socket owned by the peer's user, and neither its group nor
    /// others may write to it.
    pub(crate) fn check_socket(&self, socket: &Path, peer: PeerCredentials) -> Result<(), TrustError> {
        self.check_peer(peer)?;
        let meta = std::fs::symlink_metadata(socket).map_err(|e| TrustError::Unreadable(e.to_string()))?;
        if !meta.file_type().is_socket() {
            return Err(TrustError::NotASocket);
        }
        if meta.uid() != peer.uid {
            return Err(TrustError::Owner { owner: meta.uid(), uid: peer.uid });
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o022 != 0 {
            return Err(TrustError::Mode { mode });
        }
        Ok(())
    }

    fn allowed_list(&self) -> String {
        if self.allowed_uids.is_empty() {
            return "empty".to_owned();
        }
        self.allowed_uids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn peer(uid: u32) -> PeerCredentials {
        PeerCredentials { uid, gid: uid, pid: Some(42) }
    }

    #[test]
    fn root_and_listed_users_are_trusted_others_are_not() {
        let trust = PluginTrust::new([1000]);
        assert!(trust.check_peer(peer(0)).is_ok());
        assert!(trust.check_peer(peer(1000)).is_ok());
        let refused = trust.check_peer(peer(65534)).expect_err("refused").to_string();
        assert!(refused.contains("uid 65534") && refused.contains("pid 42") && refused.contains("(1000)"), "{refused}");
        let refused = PluginTrust::default().check_peer(peer(1)).expect_err("refused").to_string();
        assert!(refused.contains("--plugin-allowed-uids (empty)"), "{refused}");
    }

    #[test]
    fn a_socket_must_be_the_peers_and_writable_by_it_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let own = std::fs::metadata(&path).expect("meta").uid();
        let trust = PluginTrust::new([own]);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        assert_eq!(trust.check_socket(&path, peer(own)), Ok(()));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let refused = trust.check_socket(&path, peer(own)).expect_err("world-writable").to_string();
        assert!(refused.contains("mode 0777"), "{refused}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let other = if own == 0 { 1000 } else { 0 };
        let trust = PluginTrust::new([own, other]);
        let refused = trust.check_socket(&path, peer(other)).expect_err("someone else's socket").to_string();
        assert!(refused.contains(&format!("owned by uid {own}")), "{refused}");
        std::fs::write(dir.path().join("f"), "").expect("file");
        assert!(trust.check_socket(&dir.path().join("f"), peer(own)).is_err(), "not a socket");
    }
}
