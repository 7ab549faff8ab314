//! Running a test's binary as another user, from wherever the repository
//! is checked out.
//!
//! The build directory lies inside the checkout, and a checkout under a
//! home directory of mode 0700 (root's, by default) is closed to every
//! other user: uid 65534 cannot reach `target/debug/fake-device-plugin`
//! there, whatever the binary's own mode. [`ReachableBinary`] puts the
//! binary where that user can reach it, in a fresh directory of mode 0755
//! under the system's temporary directory.
//!
//! [`rerun_behind_a_closed_directory`] proves it: it runs a test again in a
//! private mount namespace where the build directory sits behind a
//! directory only root may enter, as it does in such a checkout.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::skip::{self, Need};

/// The user (and group) the tests run other users' processes as.
pub const NOBODY: u32 = 65534;

/// A copy of a binary in a directory every user may enter; removed when
/// dropped.
pub struct ReachableBinary {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl ReachableBinary {
    /// `binary` (which keeps its file name), hard-linked where it can be
    /// (the same file system) and copied otherwise.
    pub fn new(binary: &Path) -> Result<ReachableBinary, String> {
        use std::os::unix::fs::PermissionsExt as _;
        let name = binary.file_name().ok_or_else(|| format!("{} names no file", binary.display()))?;
        let dir = tempfile::Builder::new()
            .prefix("rustlet-reachable-")
            .tempdir()
            .map_err(|e| format!("a temporary directory: {e}"))?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", dir.path().display()))?;
        let path = dir.path().join(name);
        if std::fs::hard_link(binary, &path).is_err() {
            std::fs::copy(binary, &path)
                .map_err(|e| format!("copy {} to {}: {e}", binary.display(), path.display()))?;
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", path.display()))?;
        Ok(ReachableBinary { path, _dir: dir })
    }

    /// Where the binary is now.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The variable that marks the run inside the closed namespace (so that a
/// rerun never reruns itself).
const CLOSED: &str = "RUSTLET_TEST_BEHIND_CLOSED_DIRECTORY";

/// Runs test `name` of this test binary again, as root, in a private mount
/// namespace where the build directory (`target/<profile>`, this binary's
/// grandparent) is a tmpfs of mode 0700 with the real directory's entries
/// bound back into it: root sees every file where it was, and no other
/// user can reach any of them, as in a checkout under a 0700 home. The
/// rerun must pass (`RUSTLET_REQUIRE_ROOT=1` there: it cannot skip).
/// [`skip`]s `test` where this is not root or cannot mount.
pub fn rerun_behind_a_closed_directory(test: &str, name: &str) {
    if std::env::var_os(CLOSED).is_some() || !skip::root(test, "a private mount namespace needs root") {
        return;
    }
    let exe = std::env::current_exe().expect("this test binary");
    let build_dir = exe.parent().and_then(Path::parent).expect("the build directory (target/<profile>/deps/<test>)");
    let held = tempfile::Builder::new().prefix("rustlet-build-dir-").tempdir().expect("tempdir");
    // Inside the namespace: hold the real directory at `$2`, cover it with
    // the closed tmpfs, bind each entry back, check that uid 65534 is kept
    // out, then become the test.
    let script = r#"
set -e
real=$1; held=$2; shift 2
mount --bind "$real" "$held"
mount -t tmpfs -o mode=0700 rustlet-closed "$real"
for entry in "$held"/* "$held"/.[!.]*; do
    [ -e "$entry" ] || continue
    name=${entry##*/}
    if [ -d "$entry" ]; then mkdir "$real/$name"; else touch "$real/$name"; fi
    mount --bind "$entry" "$real/$name"
done
if setpriv --reuid 65534 --regid 65534 --clear-groups test -x "$1"; then
    echo "uid 65534 can still reach $1: the directory is not closed" >&2
    exit 97
fi
exec "$@"
"#;
    let output = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", script, "sh"])
        .arg(build_dir)
        .arg(held.path())
        .arg(&exe)
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(CLOSED, "1")
        .env(Need::Root.variable(), "1")
        .output();
    let output = match output {
        Ok(output) => output,
        Err(error) => return skip::skip(test, Need::Mounts, format!("cannot run unshare: {error}")),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if output.status.code() == Some(97) {
        panic!("{test}: the closed directory let uid 65534 in: {stderr}");
    }
    if !output.status.success() && stderr.contains("mount:") && !stdout.contains("running 1 test") {
        return skip::skip(test, Need::Mounts, format!("the private namespace could not be set up: {}", stderr.trim()));
    }
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "{name} failed behind a directory other users cannot enter ({}):\n{stdout}\n{stderr}",
        output.status
    );
}
