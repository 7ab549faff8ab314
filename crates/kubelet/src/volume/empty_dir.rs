//! `emptyDir` volumes: a directory per pod under the pod's volume dir,
//! removed with the pod; `medium: Memory` is a tmpfs where the node may
//! mount one.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::VolumeError;

/// Creates the volume's directory (a tmpfs for `medium: Memory`, when the
/// node can mount; otherwise a plain directory and a warning).
pub fn prepare(volume: &str, dir: &Path, memory: bool, size_limit: Option<&str>) -> Result<PathBuf, VolumeError> {
    std::fs::create_dir_all(dir).map_err(|source| VolumeError::Io {
        volume: volume.to_owned(),
        path: dir.to_owned(),
        source,
    })?;
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
    Ok(dir.to_owned())
}

/// Unmounts (if it is a mount) and removes the volume's directory.
pub fn teardown(volume: &str, dir: &Path) -> Result<(), VolumeError> {
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
