//! `hostPath` volumes: the path on the host, checked against its `type` as
//! upstream checks it.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::VolumeError;

/// What a `hostPath` volume's `type` requires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPathType {
    /// No check (empty type).
    Unchecked,
    /// A directory, created (0755) when missing.
    DirectoryOrCreate,
    /// An existing directory.
    Directory,
    /// A file, created empty (0644) when missing; its parent must exist.
    FileOrCreate,
    /// An existing file.
    File,
    /// An existing Unix socket.
    Socket,
    /// An existing character device.
    CharDevice,
    /// An existing block device.
    BlockDevice,
}

impl HostPathType {
    /// Reads a `type` value; `None` for one upstream does not know.
    pub(crate) fn parse(value: Option<&str>) -> Option<HostPathType> {
        Some(match value.unwrap_or("") {
            "" => HostPathType::Unchecked,
            "DirectoryOrCreate" => HostPathType::DirectoryOrCreate,
            "Directory" => HostPathType::Directory,
            "FileOrCreate" => HostPathType::FileOrCreate,
            "File" => HostPathType::File,
            "Socket" => HostPathType::Socket,
            "CharDevice" => HostPathType::CharDevice,
            "BlockDevice" => HostPathType::BlockDevice,
            _ => return None,
        })
    }
}

/// Checks (and for the `…OrCreate` types, creates) a `hostPath` volume's
/// path; returns it.
pub(crate) fn prepare(volume: &str, path: &str, kind: Option<&str>) -> Result<PathBuf, VolumeError> {
    let host_path = PathBuf::from(path);
    let Some(kind) = HostPathType::parse(kind) else {
        return Err(VolumeError::InvalidSpec {
            volume: volume.to_owned(),
            reason: format!("unknown hostPath type {:?}", kind.unwrap_or_default()),
        });
    };
    let mismatch = |expected: &str| VolumeError::HostPathType {
        volume: volume.to_owned(),
        path: host_path.clone(),
        expected: expected.to_owned(),
    };
    let file_type = std::fs::metadata(&host_path).map(|m| m.file_type());
    match kind {
        HostPathType::Unchecked => {}
        HostPathType::DirectoryOrCreate => match file_type {
            Ok(t) if t.is_dir() => {}
            Ok(_) => return Err(mismatch("directory")),
            Err(_) => std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(&host_path)
                .map_err(|source| VolumeError::Io { volume: volume.to_owned(), path: host_path.clone(), source })?,
        },
        HostPathType::FileOrCreate => match file_type {
            Ok(t) if t.is_file() => {}
            Ok(_) => return Err(mismatch("file")),
            Err(_) => {
                create_file(&host_path).map_err(|source| VolumeError::Io {
                    volume: volume.to_owned(),
                    path: host_path.clone(),
                    source,
                })?;
            }
        },
        HostPathType::Directory => {
            check(&file_type, |t| t.is_dir()).then_some(()).ok_or_else(|| mismatch("directory"))?
        }
        HostPathType::File => check(&file_type, |t| t.is_file()).then_some(()).ok_or_else(|| mismatch("file"))?,
        HostPathType::Socket => {
            check(&file_type, |t| t.is_socket()).then_some(()).ok_or_else(|| mismatch("socket file"))?
        }
        HostPathType::CharDevice => {
            check(&file_type, |t| t.is_char_device()).then_some(()).ok_or_else(|| mismatch("character device"))?
        }
        HostPathType::BlockDevice => {
            check(&file_type, |t| t.is_block_device()).then_some(()).ok_or_else(|| mismatch("block device"))?
        }
    }
    Ok(host_path)
}

fn check(file_type: &std::io::Result<std::fs::FileType>, want: impl Fn(&std::fs::FileType) -> bool) -> bool {
    file_type.as_ref().is_ok_and(want)
}

fn create_file(path: &Path) -> std::io::Result<()> {
    // The parent must exist (upstream does not create it for FileOrCreate).
    std::fs::OpenOptions::new().write(true).create(true).truncate(false).mode(0o644).open(path).map(drop)
}
