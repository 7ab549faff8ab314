//! Container log rotation as the kubelet does it: every period, each
//! running container's log (`logs/pods/<ns>_<name>_<uid>/<container>/<restart>.log`)
//! that reached `--container-log-max-size` is rotated: leftovers of an
//! interrupted rotation are removed, the oldest rotated files go until
//! `--container-log-max-files` − 2 are left, those left are compressed
//! (`.gz`), the live log is renamed `<log>.<YYYYMMDD-hhmmss>`, and the
//! provider is asked to reopen it (CRI `ReopenContainerLog`; the
//! WebAssembly provider reopens its own file). If the reopen fails the
//! rename is undone. So a container keeps at most `max-files` files: the
//! live one, one rotated uncompressed, the rest compressed.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flate2::Compression;
use flate2::write::GzEncoder;
use k8s_openapi::api::core::v1::Pod;
use kubelet_provider::{ContainerId, Provider, ProviderErrorKind};
use tokio_util::sync::CancellationToken;

use crate::pod::{PodStore, pod_log_dir};

/// How logs are rotated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogRotation {
    /// A log is rotated once it has this many bytes (`--container-log-max-size`, 10Mi).
    pub max_size: u64,
    /// Files a container keeps at most, the live one included
    /// (`--container-log-max-files`, 5; at least 2).
    pub max_files: usize,
    /// How often logs are checked (upstream: 10 s).
    pub period: Duration,
}

impl Default for LogRotation {
    fn default() -> Self {
        LogRotation { max_size: 10 << 20, max_files: 5, period: Duration::from_secs(10) }
    }
}

/// A setting that cannot be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid MaxFiles {0}, must be > 1")]
pub struct InvalidMaxFiles(pub usize);

impl LogRotation {
    /// Checks the settings as upstream does.
    pub fn validate(&self) -> Result<(), InvalidMaxFiles> {
        if self.max_files < 2 { Err(InvalidMaxFiles(self.max_files)) } else { Ok(()) }
    }
}

/// Rotates the running containers' logs every period until `shutdown`.
pub async fn run(
    rotation: LogRotation,
    root_dir: PathBuf,
    store: PodStore,
    provider: Arc<dyn Provider>,
    shutdown: CancellationToken,
) {
    tracing::info!(max_size = rotation.max_size, max_files = rotation.max_files, period = ?rotation.period, "container log rotation");
    loop {
        for (id, log) in running_logs(&root_dir, &store.list()) {
            if let Err(error) = rotate_if_due(&rotation, &id, &log, provider.as_ref()).await {
                tracing::warn!(container = %id.0, log = %log.display(), %error, "log rotation failed");
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(rotation.period) => {}
        }
    }
}

/// The running containers of `pods` and their log files.
fn running_logs(root_dir: &Path, pods: &[Pod]) -> Vec<(ContainerId, PathBuf)> {
    let mut logs = Vec::new();
    for pod in pods {
        let meta = &pod.metadata;
        let dir = pod_log_dir(
            root_dir,
            meta.namespace.as_deref().unwrap_or("default"),
            meta.name.as_deref().unwrap_or_default(),
            meta.uid.as_deref().unwrap_or_default(),
        );
        let status = pod.status.as_ref();
        let statuses = status.into_iter().flat_map(|s| {
            s.init_container_statuses
                .iter()
                .flatten()
                .chain(s.container_statuses.iter().flatten())
                .chain(s.ephemeral_container_statuses.iter().flatten())
        });
        for container in statuses {
            if container.state.as_ref().and_then(|s| s.running.as_ref()).is_none() {
                continue;
            }
            let Some(id) = container.container_id.as_deref() else { continue };
            let id = id.split_once("://").map_or(id, |(_, raw)| raw);
            let log = dir.join(&container.name).join(format!("{}.log", container.restart_count));
            logs.push((ContainerId(id.to_owned()), log));
        }
    }
    logs
}

/// Why a rotation failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RotationError {
    /// A file operation.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was done.
        what: &'static str,
        /// The file.
        path: String,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// The provider could not reopen the log (the rename was undone).
    #[error("reopening the log: {0}")]
    Reopen(String),
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RotationError + 'a {
    move |source| RotationError::Io { what, path: path.display().to_string(), source }
}

/// Rotates `log` of container `id` if it reached the size. `Ok(true)`: it
/// was rotated.
pub(crate) async fn rotate_if_due(
    rotation: &LogRotation,
    id: &ContainerId,
    log: &Path,
    provider: &dyn Provider,
) -> Result<bool, RotationError> {
    let size = match std::fs::metadata(log) {
        Ok(meta) => meta.len(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            // Gone (a rotation whose reopen was lost): the provider makes it again.
            if let Err(error) = provider.reopen_container_log(id).await
                && error.kind != ProviderErrorKind::Unsupported
            {
                return Err(RotationError::Reopen(error.message));
            }
            return Ok(false);
        }
        Err(error) => return Err(io("reading", log)(error)),
    };
    if size < rotation.max_size {
        return Ok(false);
    }
    let rotated = rotated_name(log, jiff::Zoned::now());
    if rotated.exists() {
        // Rotated this second already: the next check rotates it.
        return Ok(false);
    }
    prune_and_compress(log, rotation.max_files)?;
    std::fs::rename(log, &rotated).map_err(io("renaming", log))?;
    if let Err(error) = provider.reopen_container_log(id).await {
        // Put back: the container still writes to it.
        let undone = std::fs::rename(&rotated, log);
        if let Err(undo) = undone {
            tracing::warn!(log = %log.display(), error = %undo, "cannot undo a rotation");
        }
        return Err(RotationError::Reopen(error.message));
    }
    tracing::debug!(container = %id.0, log = %log.display(), size, "container log rotated");
    Ok(true)
}

/// `<log>.<YYYYMMDD-hhmmss>` in the node's local time, as upstream names it.
fn rotated_name(log: &Path, now: jiff::Zoned) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(format!(".{}", now.strftime("%Y%m%d-%H%M%S")));
    PathBuf::from(name)
}

/// Before a rotation: removes `.tmp` leftovers and files whose `.gz` exists,
/// the oldest rotated files beyond `max_files − 2`, and compresses the rest.
fn prune_and_compress(log: &Path, max_files: usize) -> Result<(), RotationError> {
    let mut rotated = rotated_files(log);
    let exists = |p: &PathBuf| p.exists();
    rotated.retain(|file| {
        let name = file.to_string_lossy();
        let leftover =
            name.ends_with(".tmp") || (!name.ends_with(".gz") && exists(&PathBuf::from(format!("{name}.gz"))));
        if leftover && let Err(error) = std::fs::remove_file(file) {
            tracing::warn!(file = %name, %error, "cannot remove a log rotation leftover");
        }
        !leftover
    });
    rotated.sort();
    let keep = max_files.saturating_sub(2);
    while rotated.len() > keep {
        let oldest = rotated.remove(0);
        std::fs::remove_file(&oldest).map_err(io("removing", &oldest))?;
    }
    for file in rotated.iter().filter(|f| !f.to_string_lossy().ends_with(".gz")) {
        compress(file)?;
    }
    Ok(())
}

/// The rotated files of `log` (`<log>.*`).
fn rotated_files(log: &Path) -> Vec<PathBuf> {
    let (Some(dir), Some(name)) = (log.parent(), log.file_name().and_then(|n| n.to_str())) else { return Vec::new() };
    let prefix = format!("{name}.");
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// `file` → `file.gz` (through `file.tmp`), then `file` removed.
fn compress(file: &Path) -> Result<(), RotationError> {
    let tmp = PathBuf::from(format!("{}.tmp", file.display()));
    let gz = PathBuf::from(format!("{}.gz", file.display()));
    let mut input = std::fs::File::open(file).map_err(io("opening", file))?;
    let output = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
    let mut encoder = GzEncoder::new(output, Compression::default());
    std::io::copy(&mut input, &mut encoder).map_err(io("compressing", file))?;
    let mut output = encoder.finish().map_err(io("compressing", file))?;
    output.flush().map_err(io("writing", &tmp))?;
    std::fs::rename(&tmp, &gz).map_err(io("renaming", &tmp))?;
    std::fs::remove_file(file).map_err(io("removing", file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotated_files_are_pruned_and_compressed_as_upstream() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("0.log");
        std::fs::write(&log, "live").expect("write");
        for (name, text) in [
            ("0.log.20260101-000001.gz", "a"),
            ("0.log.20260101-000002.gz", "b"),
            ("0.log.20260101-000003", "c"),
            ("0.log.20260101-000004", "d"),
            ("0.log.20260101-000004.gz", "d twin"),
            ("0.log.20260101-000005.tmp", "half"),
        ] {
            std::fs::write(dir.path().join(name), text).expect("write");
        }
        prune_and_compress(&log, 4).expect("pruned");
        let mut names: Vec<String> =
            rotated_files(&log).iter().filter_map(|p| p.file_name()?.to_str().map(str::to_owned)).collect();
        names.sort();
        // 4 files at most: the live one, the one about to be rotated, two older.
        assert_eq!(names, ["0.log.20260101-000003.gz", "0.log.20260101-000004.gz"]);
        let gz = std::fs::read(dir.path().join("0.log.20260101-000003.gz")).expect("gz");
        let mut text = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&gz[..]), &mut text).expect("gunzip");
        assert_eq!(text, "c");
        assert_eq!(InvalidMaxFiles(1).to_string(), "invalid MaxFiles 1, must be > 1");
        assert!(LogRotation { max_files: 1, ..LogRotation::default() }.validate().is_err());
    }

    #[test]
    fn rotated_names_carry_the_local_time() {
        let at = "2026-11-26T13:04:05Z".parse::<jiff::Timestamp>().expect("time").to_zoned(jiff::tz::TimeZone::UTC);
        assert_eq!(rotated_name(Path::new("/l/0.log"), at), PathBuf::from("/l/0.log.20261126-130405"));
    }
}
