//! A volume's files given to the pod's `fsGroup`, as the kubelet's volume
//! ownership change does it (`SetVolumeOwnership`): every file and
//! directory under the volume gets the group (symlinks themselves, not
//! what they point at), read and write for the group (read only, for a
//! read-only volume), and directories also the group's search bit and
//! setgid, so that what the containers make later keeps the group. With
//! the pod's `fsGroupChangePolicy: OnRootMismatch`, nothing is walked when
//! the volume's root already has the group and those bits.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// The group bits a writable volume's files get (the kubelet's `rwMask`).
const READ_WRITE: u32 = 0o660;
/// The group bits a read-only volume's files get (`roMask`).
const READ_ONLY: u32 = 0o440;
/// What directories get besides (`execMask` and setgid).
const DIRECTORY: u32 = 0o110 | 0o2000;

/// Gives everything under `dir` to group `gid` (see the module's doc);
/// returns how many entries it changed. A file that cannot be changed is
/// logged and passed over, as upstream; a directory that cannot be read is
/// an error.
pub(crate) fn apply(dir: &Path, gid: u32, read_only: bool, on_root_mismatch: bool) -> std::io::Result<usize> {
    if on_root_mismatch && !root_mismatches(dir, gid, read_only) {
        tracing::debug!(path = %dir.display(), gid, "volume ownership already matches its root: not walked");
        return Ok(0);
    }
    let mask = if read_only { READ_ONLY } else { READ_WRITE };
    let mut changed = 0;
    let mut pending = vec![dir.to_owned()];
    while let Some(path) = pending.pop() {
        let meta = std::fs::symlink_metadata(&path)?;
        if let Err(error) = std::os::unix::fs::lchown(&path, None, Some(gid)) {
            tracing::warn!(path = %path.display(), gid, %error, "cannot give a volume's file to the pod's fsGroup");
        }
        changed += 1;
        if meta.file_type().is_symlink() {
            // A symlink's mode means nothing; chmod would reach its target.
            continue;
        }
        let extra = if meta.is_dir() { mask | DIRECTORY } else { mask };
        let mode = meta.permissions().mode() & 0o7777;
        if mode & extra != extra
            && let Err(error) = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode | extra))
        {
            tracing::warn!(path = %path.display(), %error, "cannot set a volume's file's group bits");
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                pending.push(entry?.path());
            }
        }
    }
    Ok(changed)
}

/// Whether the volume's root lacks the group, its bits or setgid (the
/// kubelet's `requiresPermissionChange`); a root that cannot be read, or
/// is not a directory, needs the walk.
fn root_mismatches(dir: &Path, gid: u32, read_only: bool) -> bool {
    let Ok(meta) = std::fs::metadata(dir) else { return true };
    if meta.gid() != gid || !meta.is_dir() {
        return true;
    }
    let wanted = (if read_only { READ_ONLY } else { READ_WRITE }) | 0o110;
    let mode = meta.permissions().mode();
    mode & wanted != wanted || mode & 0o2000 == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).expect("meta").permissions().mode() & 0o7777
    }

    #[test]
    fn files_and_dirs_get_the_group_its_bits_and_dirs_setgid() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("volume");
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        std::fs::set_permissions(dir.join("sub"), std::fs::Permissions::from_mode(0o700)).expect("chmod");
        std::fs::write(dir.join("sub/file"), "x").expect("file");
        std::fs::set_permissions(dir.join("sub/file"), std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let outside = root.path().join("outside");
        std::fs::write(&outside, "y").expect("outside");
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        std::os::unix::fs::symlink(&outside, dir.join("link")).expect("symlink");
        // Our own group: a change to it needs no privilege.
        let gid = std::fs::metadata(root.path()).expect("meta").gid();
        assert_eq!(apply(&dir, gid, false, false).expect("applied"), 4);
        assert_eq!(mode(&dir), 0o2770);
        assert_eq!(mode(&dir.join("sub")), 0o2770);
        assert_eq!(mode(&dir.join("sub/file")), 0o660);
        assert_eq!(mode(&outside), 0o600, "a symlink's target is not changed");
        assert_eq!(std::fs::metadata(dir.join("sub/file")).expect("meta").gid(), gid);

        // OnRootMismatch: the root matches now, so nothing is walked.
        std::fs::set_permissions(dir.join("sub/file"), std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(apply(&dir, gid, false, true).expect("skipped"), 0);
        assert_eq!(mode(&dir.join("sub/file")), 0o600);
        // Without the policy (or with the root's bits gone) it is.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750)).expect("chmod");
        assert_eq!(apply(&dir, gid, true, true).expect("walked"), 4);
        assert_eq!(mode(&dir.join("sub/file")), 0o640, "read only: the group reads");
    }
}
