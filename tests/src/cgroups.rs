//! A cgroup root of one test's, so that the node's `kubepods` hierarchy of
//! one test neither meets another's nor outlives the test.

use kubelet::provider::cgroups::CgroupFs;

/// `/rustlet-test-<name>-<pid>` on the host's cgroup file system; removed,
/// deepest groups first, when dropped (a group still holding a process is
/// left, and said so).
pub struct TestCgroupRoot {
    /// The root's name, for `--cgroup-root` or [`QosCgroupSettings::root`].
    ///
    /// [`QosCgroupSettings::root`]: kubelet::provider::cgroups::QosCgroupSettings::root
    pub name: String,
    /// The host's cgroup file system.
    pub fs: CgroupFs,
}

impl TestCgroupRoot {
    /// A root for `test`; `None` (the test skips, saying why) without a
    /// cgroup file system this process may write.
    pub fn new(test: &str) -> Option<TestCgroupRoot> {
        let Some(fs) = CgroupFs::detect() else {
            eprintln!("skipping {test}: no cgroup file system at /sys/fs/cgroup");
            return None;
        };
        let short: String = test.chars().filter(char::is_ascii_alphanumeric).take(24).collect();
        let name = format!("/rustlet-test-{short}-{}", std::process::id());
        let root = TestCgroupRoot { name, fs };
        if let Err(error) = root.fs.ensure(&root.name, &Default::default()) {
            eprintln!("skipping {test}: cannot make a cgroup: {error}");
            return None;
        }
        Some(root)
    }
}

impl Drop for TestCgroupRoot {
    fn drop(&mut self) {
        for dir in self.fs.dirs(&self.name) {
            remove_tree(&dir);
        }
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
