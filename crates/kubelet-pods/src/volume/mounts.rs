//! The mounts the node sees, from `/proc/self/mountinfo`, and a directory
//! removal that never crosses one: a pod's directory holds its volumes, and
//! a volume still mounted there (a CSI publish at `<volume>/mount`, a bind
//! mount on the same file system, which a device-number check misses) is
//! somebody's data.

use std::path::{Path, PathBuf};

/// The mount points listed in `/proc/self/mountinfo` (empty if it cannot
/// be read).
pub(crate) fn mount_points() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo").map(|text| parse_mountinfo(&text)).unwrap_or_default()
}

/// The mount points (field 5) of a mountinfo text, with the kernel's octal
/// escapes (`\040` for a space, …) decoded.
pub(crate) fn parse_mountinfo(text: &str) -> Vec<PathBuf> {
    text.lines().filter_map(|line| line.split(' ').nth(4)).map(|field| PathBuf::from(unescape(field))).collect()
}

/// Whether the mount holding `dir` (the longest mount point that is `dir`
/// or above it, in the mountinfo `text`) is a shared one: its optional
/// fields (from field 7 up to the `-`) carry `shared:<peer group>`.
pub(crate) fn on_shared_mount(text: &str, dir: &Path) -> bool {
    let mut best: Option<(usize, bool)> = None;
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(point) = fields.get(4).map(|f| PathBuf::from(unescape(f))) else { continue };
        if !dir.starts_with(&point) {
            continue;
        }
        let depth = point.components().count();
        let shared = fields.iter().skip(6).take_while(|f| **f != "-").any(|f| f.starts_with("shared:"));
        // The later of two mounts on the same point is the one on top.
        if best.is_none_or(|(d, _)| depth >= d) {
            best = Some((depth, shared));
        }
    }
    best.is_some_and(|(_, shared)| shared)
}

/// What [`make_rshared`] found or did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedMount {
    /// `dir` was on a shared mount already (a systemd host's `/` is).
    AlreadyShared,
    /// `dir` was bind-mounted on itself and made a shared mount, recursively.
    Made,
}

/// Why [`make_rshared`] failed.
#[derive(Debug, thiserror::Error)]
pub enum SharedMountError {
    /// The bind mount of the dir on itself failed (not root, or no mount
    /// privilege in this mount namespace).
    #[error("failed to bind-mount {}: {source}", dir.display())]
    Bind {
        /// The dir.
        dir: PathBuf,
        /// The mount's error.
        #[source]
        source: std::io::Error,
    },
    /// The change to shared propagation failed.
    #[error("failed to make {} rshared: {source}", dir.display())]
    Share {
        /// The dir.
        dir: PathBuf,
        /// The mount's error.
        #[source]
        source: std::io::Error,
    },
}

/// Makes `dir` (which must exist) a shared mount, as the kubelet does with
/// its root dir at start: when the mount holding it is not shared already,
/// `dir` is bind-mounted on itself and made `rshared`. Then a mount a
/// container makes beneath a `Bidirectional` volume of `dir` (a CSI
/// driver's publish under `<dir>/pods`) reaches the host, and from there
/// every container of a `HostToContainer` or `Bidirectional` volume; a
/// runtime refuses those two propagations on a source that is not on a
/// shared (or, for `HostToContainer`, slave) mount.
///
/// The bind is never undone by the node: a plugin's pod may outlive the
/// node process, its mounts joined to this mount's peer group.
pub fn make_rshared(dir: &Path) -> Result<SharedMount, SharedMountError> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    if on_shared_mount(&text, &dir) {
        return Ok(SharedMount::AlreadyShared);
    }
    use rustix::mount::{MountPropagationFlags, mount_bind, mount_change};
    mount_bind(&dir, &dir).map_err(|e| SharedMountError::Bind { dir: dir.clone(), source: e.into() })?;
    mount_change(&dir, MountPropagationFlags::SHARED | MountPropagationFlags::REC)
        .map_err(|e| SharedMountError::Share { dir: dir.clone(), source: e.into() })?;
    Ok(SharedMount::Made)
}

fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b))
            && let Ok(code) = u8::from_str_radix(&field[i + 1..i + 4], 8)
        {
            out.push(code);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount points at or under `dir` (compared by path, `dir` made
/// absolute and free of symlinks where it exists).
pub(crate) fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    mount_points().into_iter().filter(|m| m.starts_with(&dir)).collect()
}

/// Whether `dir` itself is a mount point.
pub fn is_mount_point(dir: &Path) -> bool {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    mount_points().contains(&dir)
}

/// Removes `dir` and everything in it, unless something is mounted at or
/// under it: then nothing is removed and the error names the mounts.
pub(crate) fn remove_dir_all_unmounted(dir: &Path) -> std::io::Result<()> {
    let mounted = mounts_under(dir);
    if !mounted.is_empty() {
        let list: Vec<String> = mounted.iter().map(|m| m.display().to_string()).collect();
        return Err(std::io::Error::other(format!(
            "not removing {}: still mounted under it: {}",
            dir.display(),
            list.join(", ")
        )));
    }
    match std::fs::remove_dir_all(dir) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_fields_are_read_and_unescaped() {
        let text = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                    95 22 0:45 / /var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/my\\040vol/mount rw - tmpfs tmpfs rw\n";
        assert_eq!(
            parse_mountinfo(text),
            [PathBuf::from("/"), PathBuf::from("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/my vol/mount")]
        );
    }

    #[test]
    fn the_mount_holding_a_dir_decides_whether_it_is_shared() {
        let text = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                    40 22 0:45 / /var/lib rw master:3 - tmpfs tmpfs rw\n\
                    41 40 8:1 /kubelet /var/lib/kubelet rw shared:7 master:3 - ext4 /dev/sda1 rw\n\
                    42 22 0:46 / /srv rw - tmpfs tmpfs rw\n\
                    43 42 0:47 / /srv rw shared:9 - tmpfs tmpfs rw\n";
        assert!(on_shared_mount(text, Path::new("/home/me")), "under /, shared");
        assert!(!on_shared_mount(text, Path::new("/var/lib/other")), "a slave mount is not shared");
        assert!(on_shared_mount(text, Path::new("/var/lib/kubelet/pods")), "the longest mount point wins");
        assert!(!on_shared_mount(text, Path::new("/var/lib/kubeletx")), "a path prefix is not a parent");
        assert!(on_shared_mount(text, Path::new("/srv/x")), "the mount on top of another on the same point");
        assert!(!on_shared_mount("", Path::new("/x")), "no mountinfo: not shared");
    }

    #[test]
    fn the_root_is_a_mount_point_and_a_temp_dir_has_none_under_it() {
        assert!(is_mount_point(Path::new("/")));
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(mounts_under(dir.path()).is_empty());
        std::fs::create_dir_all(dir.path().join("a/b")).expect("mkdir");
        remove_dir_all_unmounted(&dir.path().join("a")).expect("removed");
        assert!(!dir.path().join("a").exists());
        remove_dir_all_unmounted(&dir.path().join("a")).expect("a missing dir is removed already");
    }

    #[test]
    fn a_dir_with_a_mount_under_it_is_not_removed() {
        // `/proc` is a mount point under `/`: removing `/` is refused
        // before anything is touched.
        let error = remove_dir_all_unmounted(Path::new("/")).expect_err("refused");
        assert!(error.to_string().contains("still mounted under it"), "{error}");
    }
}
