//! The one way the node writes a file that must survive a crash whole:
//! checkpoints, keys, certificates, kubeconfigs, image store records.
//!
//! The bytes go to a temporary file in the same directory
//! (`.<name>.<pid>.tmp`), made new with the file's final mode
//! (`O_CREAT|O_EXCL|O_NOFOLLOW`: a file or a link someone left at that name
//! is removed, never written through), synced, renamed over the file, and
//! the directory synced, so that after a crash a reader finds the old
//! content or the new one, never a part, and the rename itself is on disk.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` durably, the file's mode `mode`.
pub fn write(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    write_with(path, mode, |file| file.write_all(bytes))
}

/// [`write()`], the content written by `fill` into the temporary file.
pub fn write_with(path: &Path, mode: u32, fill: impl FnOnce(&mut File) -> std::io::Result<()>) -> std::io::Result<()> {
    let temp = temporary_name(path)?;
    let written = (|| {
        match std::fs::remove_file(&temp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut file = create_new(&temp, mode)?;
        // The mode given, whatever the process's umask took from it.
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
        fill(&mut file)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&temp, path)?;
        sync_parent(path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written
}

/// The temporary file `path` is written through.
pub fn temporary_name(path: &Path) -> std::io::Result<PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a file path has a file name"))?;
    let mut temp = std::ffi::OsString::from(".");
    temp.push(name);
    temp.push(format!(".{}.tmp", std::process::id()));
    Ok(path.with_file_name(temp))
}

/// Creates `path` as a new file with `mode`, refusing to follow a link at
/// it and failing if anything is there already.
pub(crate) fn create_new(path: &Path, mode: u32) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)
}

/// Syncs the directory holding `path` (what makes a rename or a new link
/// in it durable).
pub fn sync_parent(path: &Path) -> std::io::Result<()> {
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    File::open(parent)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    /// A file is never written through a link or into a file someone left:
    /// the temporary file is made new, without following links.
    #[test]
    fn files_are_made_new_and_never_through_a_link() {
        let dir = tempfile::tempdir().expect("tempdir");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").expect("victim");
        let planted = dir.path().join("planted");
        std::os::unix::fs::symlink(&victim, &planted).expect("symlink");
        assert!(create_new(&planted, 0o600).is_err(), "a link is not followed");
        assert!(create_new(&victim, 0o600).is_err(), "an existing file is not opened");
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).expect("symlink");
        assert!(create_new(&dangling, 0o600).is_err(), "a dangling link is not followed either");
        assert!(!dir.path().join("nowhere").exists());

        // A link left at the temporary name is removed, not written through.
        let key = dir.path().join("kubelet.key");
        std::os::unix::fs::symlink(&victim, temporary_name(&key).expect("name")).expect("symlink");
        write(&key, b"secret", 0o600).expect("written");
        assert_eq!(std::fs::read_to_string(&victim).expect("victim"), "precious");
        assert_eq!(std::fs::read_to_string(&key).expect("key"), "secret");
        assert_eq!(std::fs::metadata(&key).expect("meta").permissions().mode() & 0o777, 0o600);
        // Written again: replaced whole, the mode given.
        write(&key, b"new", 0o644).expect("written");
        assert_eq!(std::fs::read_to_string(&key).expect("key"), "new");
        assert_eq!(std::fs::metadata(&key).expect("meta").permissions().mode() & 0o777, 0o644);
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 4, "no temporary file is left");
        // A failing fill leaves the file as it was, and no temporary file.
        let failed = write_with(&key, 0o600, |_| Err(std::io::Error::other("full")));
        assert!(failed.is_err());
        assert_eq!(std::fs::read_to_string(&key).expect("key"), "new");
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 4);
    }

    /// The mode is the one given, not what the umask leaves of it (0666 is
    /// 0644 under the usual umask of 022).
    #[test]
    fn the_mode_given_is_the_files_whatever_the_umask() {
        let dir = tempfile::tempdir().expect("tempdir");
        let shared = dir.path().join("shared");
        write(&shared, b"for everyone\n", 0o666).expect("written");
        assert_eq!(std::fs::metadata(&shared).expect("meta").permissions().mode() & 0o777, 0o666);
    }
}
