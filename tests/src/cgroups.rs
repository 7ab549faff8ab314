//! A cgroup root of one test's, so that the node's `kubepods` hierarchy of
//! one test neither meets another's nor outlives the test.

use kubelet::cgroups::CgroupFs;

use crate::skip::{Need, skip};

/// `/rustlet-test-<name>-<pid>-<count>` on the host's cgroup file system; removed,
/// deepest groups first, when dropped (a group still holding a process is
/// left, and said so).
pub struct TestCgroupRoot {
    /// The root's name, for `--cgroup-root` or [`QosCgroupSettings::root`].
    ///
    /// [`QosCgroupSettings::root`]: kubelet::cgroups::QosCgroupSettings::root
    pub name: String,
    /// The host's cgroup file system.
    pub fs: CgroupFs,
}

impl TestCgroupRoot {
    /// A root for `test`; `None` (the test [skips](crate::skip), saying
    /// why, or fails under `RUSTLET_REQUIRE_CGROUPS=1`) without a cgroup
    /// file system this process may write.
    pub fn new(test: &str) -> Option<TestCgroupRoot> {
        let Some(fs) = CgroupFs::detect() else {
            skip(test, Need::Cgroups, "no cgroup file system at /sys/fs/cgroup");
            return None;
        };
        // The name's start is for a reader; the count keeps two roots of
        // one process apart (two tests whose names begin alike, as the
        // Prometheus test's two halves do, shared one root, and the first
        // to end killed the other's containers).
        static ROOTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = ROOTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let short: String = test.chars().filter(char::is_ascii_alphanumeric).take(24).collect();
        let name = format!("/rustlet-test-{short}-{}-{n}", std::process::id());
        let root = TestCgroupRoot { name, fs };
        if let Err(error) = root.fs.ensure(&root.name, &Default::default()) {
            skip(test, Need::Cgroups, format!("cannot make a cgroup: {error}"));
            return None;
        }
        Some(root)
    }
}

impl Drop for TestCgroupRoot {
    fn drop(&mut self) {
        // What a failed test left running in the groups (its pods'
        // containers, whose node is gone) is killed first.
        for dir in self.fs.all_dirs(&self.name) {
            kill_tree(&dir);
        }
        for dir in self.fs.all_dirs(&self.name) {
            remove_tree(&dir);
        }
    }
}

/// Kills every process in the groups under `dir` and waits (briefly) for
/// them to leave.
fn kill_tree(dir: &std::path::Path) {
    let procs = |dir: &std::path::Path| -> Vec<i32> {
        std::fs::read_to_string(dir.join("cgroup.procs"))
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    };
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                kill_tree(&entry.path());
            }
        }
    }
    let pids = procs(dir);
    if pids.is_empty() {
        return;
    }
    for pid in &pids {
        let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    // A killed process leaves its group once the kernel reaped it: a
    // bounded wait, polled.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !procs(dir).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn remove_tree(dir: &std::path::Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&entry.path());
            }
        }
    }
    if let Err(error) = std::fs::remove_dir(dir)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("cgroup {} left behind: {error}", dir.display());
    }
}

/// A tmpfs of a test's own, mounted on a new temporary directory (a small
/// file system to fill). Its directory can be handed to a node as its root
/// ([`TmpfsDir::take`]); declared before the node, this guard is dropped
/// after it, and unmounts the tmpfs and removes the directory.
pub struct TmpfsDir {
    path: std::path::PathBuf,
    dir: Option<tempfile::TempDir>,
}

impl TmpfsDir {
    /// `size` bytes at most; `None` (the test [skips](crate::skip), saying
    /// why, or fails under `RUSTLET_REQUIRE_MOUNTS=1`) where this process
    /// may not mount.
    pub fn new(test: &str, size: u64) -> Option<TmpfsDir> {
        let dir = tempfile::Builder::new().prefix("rustlet-tmpfs-").tempdir().expect("tempdir");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status();
        if !status.as_ref().is_ok_and(|s| s.success()) {
            skip(test, Need::Mounts, format!("cannot mount a tmpfs ({status:?})"));
            return None;
        }
        Some(TmpfsDir { path: dir.path().to_owned(), dir: Some(dir) })
    }

    /// Its path.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The directory, for a node's root.
    pub fn take(&mut self) -> tempfile::TempDir {
        self.dir.take().expect("taken once")
    }
}

impl Drop for TmpfsDir {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.path).status();
        drop(self.dir.take());
        let _ = std::fs::remove_dir(&self.path);
    }
}
