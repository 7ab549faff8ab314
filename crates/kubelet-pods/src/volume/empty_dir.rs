//! `emptyDir` volumes: a directory per pod under the pod's volume dir,
//! removed with the pod; `medium: Memory` is a tmpfs where the node may
//! mount one (sticky, 1777, and sized as upstream sizes it). As upstream,
//! the directory is world-writable (0777), so that
//! containers running as any user can write it; with a pod `fsGroup` it
//! belongs to that group and is set-group-ID, so what is created in it does
//! too.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::VolumeError;

/// The size of a `medium: Memory` emptyDir's tmpfs, as upstream sizes it:
/// the node's allocatable memory, or the pod's memory limit if that is
/// smaller, or the volume's `sizeLimit` if that is smaller still (a zero
/// or unreadable figure is passed over); `None` when none is known (the
/// kernel's default, half of the memory).
pub(crate) fn memory_size(
    pod: &k8s_openapi::api::core::v1::Pod,
    allocatable: u128,
    size_limit: Option<&str>,
) -> Option<u128> {
    let mut size = (allocatable > 0).then_some(allocatable);
    let totals = kubelet_support::cgroups::pod_totals(pod);
    let pod_limit = (totals.memory_limited && totals.memory_limit > 0).then_some(totals.memory_limit);
    for candidate in [pod_limit, size_limit.and_then(|q| kubelet_provider::quantity::parse_units(q).ok())] {
        if let Some(bytes) = candidate.filter(|b| *b > 0)
            && size.is_none_or(|s| bytes <= s)
        {
            size = Some(bytes);
        }
    }
    size
}

/// Creates the volume's directory (a tmpfs of `size` bytes, when given,
/// for `medium: Memory`, when the node can mount; otherwise a plain
/// directory and a warning), mode 0777, in `fs_group` when the pod has
/// one.
pub(crate) fn prepare(
    volume: &str,
    dir: &Path,
    memory: bool,
    size: Option<u128>,
    fs_group: Option<u32>,
) -> Result<PathBuf, VolumeError> {
    let io = |source: std::io::Error| VolumeError::Io { volume: volume.to_owned(), path: dir.to_owned(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    if memory && !is_mount_point(dir) {
        // In bytes: the kernel reads `k`, `m`, `g`, not a quantity's `Mi`.
        let mut options = "mode=1777".to_owned();
        if let Some(bytes) = size {
            options.push_str(&format!(",size={bytes}"));
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
    // The umask narrowed what create_dir_all made: set the mode itself. A
    // tmpfs keeps its sticky bit (upstream mounts it with the kernel's
    // 1777 and sets only the permission bits), which a subPath made in it
    // copies.
    let mut mode = if memory && is_mount_point(dir) { 0o1777 } else { 0o777 };
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
    fn a_memory_volume_is_the_smallest_of_allocatable_the_pod_limit_and_its_size_limit() {
        let pod = |limits: &[Option<&str>]| -> k8s_openapi::api::core::v1::Pod {
            let containers: Vec<serde_json::Value> = limits
                .iter()
                .enumerate()
                .map(|(i, l)| match l {
                    Some(l) => serde_json::json!({"name": format!("c{i}"), "resources": {"limits": {"memory": l}}}),
                    None => serde_json::json!({"name": format!("c{i}")}),
                })
                .collect();
            serde_json::from_value(serde_json::json!({"spec": {"containers": containers}})).expect("pod")
        };
        let gib = 1u128 << 30;
        assert_eq!(memory_size(&pod(&[None]), 8 * gib, None), Some(8 * gib), "allocatable");
        assert_eq!(memory_size(&pod(&[Some("1Gi"), Some("1Gi")]), 8 * gib, None), Some(2 * gib), "the pod's limit");
        assert_eq!(memory_size(&pod(&[Some("1Gi"), None]), 8 * gib, None), Some(8 * gib), "not every one limited");
        assert_eq!(memory_size(&pod(&[Some("1Gi")]), 8 * gib, Some("10Mi")), Some(10 << 20), "the size limit");
        assert_eq!(
            memory_size(&pod(&[Some("1Gi")]), 8 * gib, Some("2Gi")),
            Some(gib),
            "a larger size limit is not used"
        );
        assert_eq!(memory_size(&pod(&[None]), 0, Some("0")), None, "nothing known: the kernel's default");
    }

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
