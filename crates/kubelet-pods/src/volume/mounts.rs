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
