//! `emptyDir` volumes: a directory per pod under the pod's volume dir,
//! removed with the pod; `medium: Memory` is a tmpfs where the node may
//! mount one. As upstream, the directory is world-writable (0777), so that
//! containers running as any user can write it; with a pod `fsGroup` it
//! belongs to that group and is set-group-ID, so what is created in it does
//! too.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::VolumeError;

/// Creates the volume's directory (a tmpfs for `medium: Memory`, when the
/// node can mount; otherwise a plain directory and a warning), mode 0777,
/// in `fs_group` when the pod has one.
pub(crate) fn prepare(
    volume: &str,
    dir: &Path,
    memory: bool,
    size_limit: Option<&str>,
    fs_group: Option<u32>,
) -> Result<PathBuf, VolumeError> {
    let io = |source: std::io::Error| VolumeError::Io { volume: volume.to_owned(), path: dir.to_owned(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    if memory && !is_mount_point(dir) {
        let mut options = "mode=0777".to_owned();
        if let Some(limit) = size_limit {
            options.push_str(&format!(",size={limit}"));
        }
        let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", &options, "tmpfs"]).arg(dir).output();
        match mounted {
            Ok(output) if output.status.success() => {
                tracing::info!(volume, path = %dir.display(), "emptyDir mounted as tmpfs");
            }
            Ok(output) => tracing::warn!(
                volume,
                error = %String::from_utf8_lossy(&output.stderr).trim(),
                "emptyDir with medium Memory is a plain directory: tmpfs could not be mounted"
            ),
            Err(error) => tracing::warn!(
                volume,
                %error,
                "emptyDir with medium Memory is a plain directory: mount could not be run"
            ),
        }
    }
    // The umask narrowed what create_dir_all made: set the mode itself.
    let mut mode = 0o777;
    if let Some(gid) = fs_group {
        super::atomic_writer::set_group(dir, gid).map_err(io)?;
        mode |= 0o2000;
    }
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(mode)).map_err(io)?;
    Ok(dir.to_owned())
}

/// Unmounts (if it is a mount) and removes the volume's directory.
pub(crate) fn teardown(volume: &str, dir: &Path) -> Result<(), VolumeError> {
    if is_mount_point(dir) {
        let output = Command::new("umount").arg(dir).output().map_err(|source| VolumeError::Io {
            volume: volume.to_owned(),
            path: dir.to_owned(),
            source,
        })?;
        if !output.status.success() {
            return Err(VolumeError::Teardown {
                volume: volume.to_owned(),
                reason: format!("umount {}: {}", dir.display(), String::from_utf8_lossy(&output.stderr).trim()),
            });
        }
    }
    super::mounts::remove_dir_all_unmounted(dir).map_err(|source| VolumeError::Io {
        volume: volume.to_owned(),
        path: dir.to_owned(),
        source,
    })
}

/// Whether `dir` is a mount point (listed in `/proc/self/mountinfo`, so a
/// bind mount on the same file system counts), or its device differs from
/// its parent's.
pub(crate) fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if super::mounts::is_mount_point(dir) {
        return true;
    }
    let (Ok(own), Some(Ok(parent))) = (std::fs::metadata(dir), dir.parent().map(std::fs::metadata)) else {
        return false;
    };
    own.dev() != parent.dev()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};

    use super::*;

    #[test]
    fn the_directory_is_world_writable_whatever_the_umask() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("v");
        prepare("v", &dir, false, None, None).expect("prepare");
        assert_eq!(std::fs::metadata(&dir).expect("meta").permissions().mode() & 0o7777, 0o777);
    }

    #[test]
    fn an_fs_group_owns_the_directory_and_is_inherited() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("v");
        // Our own group: chown to it works without privileges.
        let gid = std::fs::metadata(root.path()).expect("meta").gid();
        prepare("v", &dir, false, None, Some(gid)).expect("prepare");
        let meta = std::fs::metadata(&dir).expect("meta");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o2777);
        assert_eq!(meta.gid(), gid);
    }
}
