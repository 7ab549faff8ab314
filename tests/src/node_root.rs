//! Root dirs for the nodes under test.
//!
//! A node makes its root dir a shared mount at start, as the kubelet does
//! (bind-mounted on itself when the mount holding it is not shared), and
//! never undoes that: a plugin's pod may outlive the node. A test's temp
//! dir would keep that mount after the test. So the tests' root dirs live
//! under one parent per test binary that is a shared mount already (made
//! once, when the binary runs as root); when the binary exits, a watcher
//! unmounts whatever is left under it, deepest first, and removes it.

use std::path::PathBuf;
use std::sync::OnceLock;

/// The parent: its path, and the watcher's end of the pipe that holds it.
struct Parent {
    dir: PathBuf,
    _lifeline: Option<std::process::ChildStdin>,
    _watcher: Option<std::process::Child>,
}

static PARENT: OnceLock<Parent> = OnceLock::new();

fn parent() -> &'static Parent {
    PARENT.get_or_init(|| {
        let dir = tempfile::Builder::new().prefix("rustlet-roots-").tempdir().expect("the root dirs' parent").keep();
        // Other users' test plugins reach sockets below it, as under /tmp.
        let _ = std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755));
        let cleanup = "grep -F \" $0\" /proc/self/mounts | cut -d' ' -f2 | sort -r | \
                       while read -r m; do umount -l \"$m\" 2>/dev/null; done; rm -rf \"$0\"";
        let (lifeline, watcher) = crate::process::when_this_process_exits(cleanup, &[dir.display().to_string()]);
        if crate::skip::is_root()
            && let Err(error) = kubelet::volume::mounts::make_rshared(&dir)
        {
            eprintln!("warning: {} is not a shared mount ({error}): nodes will bind their own", dir.display());
        }
        Parent { dir, _lifeline: lifeline, _watcher: watcher }
    })
}

/// A temp dir for a node's root, named `<prefix>…`, under this binary's
/// shared parent.
pub fn tempdir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(prefix).tempdir_in(&parent().dir).expect("a node's root dir")
}
