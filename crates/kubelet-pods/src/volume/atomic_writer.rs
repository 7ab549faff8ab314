//! Volume contents that change while containers read them (configMap,
//! secret, projected and downwardAPI volumes), written so that a reader
//! sees either the old set of files or the new one, never a mix: the
//! kubelet's layout, which applications (and upstream's tests) rely on.
//!
//! ```text
//! <volume>/..2026_11_26_03_40_00.123456789/   the files of one version
//! <volume>/..data -> ..2026_11_26_03_40_00.123456789
//! <volume>/key    -> ..data/key                one link per top-level name
//! ```
//!
//! A new version is written whole into a fresh timestamped directory, then
//! `..data` is swapped to it with one `rename` of a new symlink over the
//! old one; top-level links are added for new names and removed for names
//! that went away; the old directory is removed last. Writing what is
//! already there changes nothing (no swap, no new directory).
//!
//! With a pod `fsGroup`, files and directories belong to that group and
//! are group-readable (upstream's ownership management of read-only
//! volumes).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use super::VolumeError;

/// One file's content and mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FileData {
    /// The bytes.
    pub content: Vec<u8>,
    /// Its permission bits (`0644`, …).
    pub mode: u32,
}

/// A volume's files by relative path.
pub(crate) type Payload = BTreeMap<String, FileData>;

/// The link to the current version.
pub(crate) const DATA_LINK: &str = "..data";
const DATA_LINK_TMP: &str = "..data_tmp";

/// Writes `payload` into `dir` as one version, if it differs from the
/// current one; returns whether anything changed.
pub(crate) fn write(volume: &str, dir: &Path, payload: &Payload, fs_group: Option<u32>) -> Result<bool, VolumeError> {
    let io = |path: &Path, source: std::io::Error| VolumeError::Io {
        volume: volume.to_owned(),
        path: path.to_owned(),
        source,
    };
    let mut top_level = BTreeSet::new();
    for path in payload.keys() {
        if path.is_empty()
            || path.starts_with('/')
            || path.starts_with("..")
            || path.split('/').any(|part| part == ".." || part.is_empty())
        {
            return Err(VolumeError::InvalidSpec {
                volume: volume.to_owned(),
                reason: format!("path {path:?} must be relative, must not contain '..' and must not start with '..'"),
            });
        }
        top_level.insert(path.split('/').next().unwrap_or(path).to_owned());
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let current = std::fs::read_link(dir.join(DATA_LINK)).ok().map(|target| dir.join(target));
    if let Some(current) = &current
        && same(current, payload, fs_group)
    {
        return Ok(false);
    }
    // 1. The new version, whole, in a directory of its own.
    let version = fresh_version_dir(dir).map_err(|e| io(dir, e))?;
    let written = write_version(&version, payload, fs_group);
    if let Err((path, source)) = written {
        let _ = std::fs::remove_dir_all(&version);
        return Err(io(&path, source));
    }
    // 2. `..data` swapped to it in one rename.
    let name = version.file_name().map(PathBuf::from).unwrap_or_default();
    let tmp = dir.join(DATA_LINK_TMP);
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&name, &tmp).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, dir.join(DATA_LINK)).map_err(|e| io(&dir.join(DATA_LINK), e))?;
    // 3. The top-level links: added for new names, removed for names gone
    // (and anything else a former layout left there).
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.flatten() {
        let entry_name = entry.file_name().to_string_lossy().into_owned();
        if entry_name.starts_with("..") || top_level.contains(&entry_name) {
            continue;
        }
        let path = entry.path();
        let removed = if entry.file_type().is_ok_and(|t| t.is_dir()) {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(|e| io(&path, e))?;
    }
    for top in &top_level {
        let link = dir.join(top);
        let wanted = Path::new(DATA_LINK).join(top);
        match std::fs::symlink_metadata(&link) {
            Ok(meta) if meta.file_type().is_symlink() && std::fs::read_link(&link).is_ok_and(|t| t == wanted) => {
                continue;
            }
            Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(&link).map_err(|e| io(&link, e))?,
            Ok(_) => std::fs::remove_file(&link).map_err(|e| io(&link, e))?,
            Err(_) => {}
        }
        std::os::unix::fs::symlink(&wanted, &link).map_err(|e| io(&link, e))?;
    }
    // 4. Older versions go.
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.flatten() {
        let entry_name = entry.file_name();
        let entry_name = entry_name.to_string_lossy();
        if entry_name.starts_with("..")
            && entry_name != DATA_LINK
            && entry.file_name() != name.as_os_str()
            && entry.file_type().is_ok_and(|t| t.is_dir())
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    tracing::debug!(volume, dir = %dir.display(), files = payload.len(), "volume contents written");
    Ok(true)
}

/// The mode a file gets: its own, group-readable with an `fsGroup`.
fn effective_mode(mode: u32, fs_group: Option<u32>) -> u32 {
    let mode = mode & 0o777;
    if fs_group.is_some() { mode | 0o440 } else { mode }
}

/// Whether `version` holds exactly `payload`.
fn same(version: &Path, payload: &Payload, fs_group: Option<u32>) -> bool {
    let mut found = Vec::new();
    if collect_files(version, version, &mut found).is_err() || found.len() != payload.len() {
        return false;
    }
    payload.iter().all(|(path, file)| {
        let full = version.join(path);
        let Ok(meta) = std::fs::metadata(&full) else { return false };
        meta.permissions().mode() & 0o777 == effective_mode(file.mode, fs_group)
            && std::fs::read(&full).is_ok_and(|content| content == file.content)
    })
}

fn collect_files(root: &Path, dir: &Path, found: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            collect_files(root, &entry.path(), found)?;
        } else {
            found.push(entry.path().strip_prefix(root).map(Path::to_owned).unwrap_or_default());
        }
    }
    Ok(())
}

/// Gives `path` to group `gid`. A node without the privilege to (not
/// root, no CAP_CHOWN) says so once and leaves the group as it is: the
/// volume still works for containers running as the node's user.
pub(crate) fn set_group(path: &Path, gid: u32) -> std::io::Result<()> {
    match std::os::unix::fs::chown(path, None, Some(gid)) {
        Err(error) if error.kind() == std::io::ErrorKind::PermissionDenied => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    path = %path.display(),
                    gid,
                    "the node may not change file groups (not root): pods' fsGroup is not applied to their volumes"
                );
            });
            Ok(())
        }
        other => other,
    }
}

/// A new, empty `..<timestamp>` directory in `dir`.
fn fresh_version_dir(dir: &Path) -> std::io::Result<PathBuf> {
    let now = k8s_openapi::jiff::Timestamp::now();
    let stamp = now.strftime("%Y_%m_%d_%H_%M_%S");
    for attempt in 0u32.. {
        let path = dir.join(format!("..{stamp}.{:09}{attempt}", now.subsec_nanosecond()));
        match std::fs::create_dir(&path) {
            Ok(()) => {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
                return Ok(path);
            }
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists && attempt < 1000 => {}
            Err(error) => return Err(error),
        }
    }
    unreachable!("the loop returns")
}

fn write_version(version: &Path, payload: &Payload, fs_group: Option<u32>) -> Result<(), (PathBuf, std::io::Error)> {
    let group = |path: &Path| match fs_group {
        Some(gid) => set_group(path, gid).map_err(|e| (path.to_owned(), e)),
        None => Ok(()),
    };
    group(version)?;
    for (relative, file) in payload {
        let path = version.join(relative);
        if let Some(parent) = path.parent()
            && parent != version
            && !parent.exists()
        {
            std::fs::create_dir_all(parent).map_err(|e| (parent.to_owned(), e))?;
            let mut up = parent;
            while up != version {
                std::fs::set_permissions(up, std::fs::Permissions::from_mode(0o755)).map_err(|e| (up.to_owned(), e))?;
                group(up)?;
                up = up.parent().unwrap_or(version);
            }
        }
        std::fs::write(&path, &file.content).map_err(|e| (path.clone(), e))?;
        group(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(effective_mode(file.mode, fs_group)))
            .map_err(|e| (path.clone(), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(files: &[(&str, &str)]) -> Payload {
        files.iter().map(|(p, c)| ((*p).to_owned(), FileData { content: c.as_bytes().to_vec(), mode: 0o644 })).collect()
    }

    #[test]
    fn a_new_version_swaps_the_data_link_and_the_top_level_links_follow() {
        let dir = tempfile::tempdir().expect("tempdir");
        let volume = dir.path().join("v");
        assert!(write("v", &volume, &payload(&[("a", "1"), ("sub/b", "2")]), None).expect("write"));
        let first = std::fs::read_link(volume.join(DATA_LINK)).expect("..data");
        assert_eq!(std::fs::read_to_string(volume.join("a")).expect("a"), "1");
        assert_eq!(std::fs::read_to_string(volume.join("sub/b")).expect("b"), "2");
        assert_eq!(std::fs::read_link(volume.join("a")).expect("link"), Path::new("..data/a"));
        // The same contents: nothing changes.
        assert!(!write("v", &volume, &payload(&[("a", "1"), ("sub/b", "2")]), None).expect("write"));
        assert_eq!(std::fs::read_link(volume.join(DATA_LINK)).expect("..data"), first);
        // New contents: `a` changes, `sub` goes, `c` comes; the old version is removed.
        assert!(write("v", &volume, &payload(&[("a", "3"), ("c", "4")]), None).expect("write"));
        let second = std::fs::read_link(volume.join(DATA_LINK)).expect("..data");
        assert_ne!(second, first);
        assert!(!volume.join(&first).exists(), "the old version is removed");
        assert_eq!(std::fs::read_to_string(volume.join("a")).expect("a"), "3");
        assert_eq!(std::fs::read_to_string(volume.join("c")).expect("c"), "4");
        assert!(std::fs::symlink_metadata(volume.join("sub")).is_err(), "a name gone is unlinked");
        let mut names: Vec<String> = std::fs::read_dir(&volume)
            .expect("dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into())
            .collect();
        names.sort();
        assert_eq!(names, [format!("{}", second.display()), "..data".into(), "a".into(), "c".into()]);
    }

    #[test]
    fn files_a_former_layout_wrote_in_place_are_replaced_by_links() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("a"), "old").expect("old file");
        std::fs::write(dir.path().join("stale"), "old").expect("stale file");
        write("v", dir.path(), &payload(&[("a", "new")]), None).expect("write");
        assert_eq!(std::fs::read_to_string(dir.path().join("a")).expect("a"), "new");
        assert!(!dir.path().join("stale").exists());
    }

    #[test]
    fn paths_leaving_the_volume_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        for bad in ["../x", "/etc/passwd", "a/../../x", "..data", "a//b"] {
            let error = write("v", dir.path(), &payload(&[(bad, "x")]), None).expect_err(bad);
            assert!(error.to_string().contains("must be relative"), "{bad}: {error}");
        }
    }

    #[test]
    fn an_fs_group_makes_files_group_readable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut files = payload(&[("secret", "s")]);
        files.get_mut("secret").expect("file").mode = 0o400;
        // Our own group: chown to it works without privileges.
        let gid = std::fs::metadata(dir.path()).map(|m| std::os::unix::fs::MetadataExt::gid(&m)).expect("gid");
        write("v", dir.path(), &files, Some(gid)).expect("write");
        let meta = std::fs::metadata(dir.path().join("secret")).expect("meta");
        assert_eq!(meta.permissions().mode() & 0o777, 0o440);
    }
}
