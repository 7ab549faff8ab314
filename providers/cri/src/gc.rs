//! Garbage collection of the runtime's exited containers and unused images,
//! as the kubelet does it.
//!
//! **Containers**: exited containers are grouped by pod and container name
//! (their labels); each group keeps its newest `keep` (the kubelet's
//! `--maximum-dead-containers-per-container`, 1, so that `kubectl logs
//! --previous` has something to read) and the rest are removed, log files
//! included.
//!
//! **Images**: when the image file system (`ImageFsInfo`'s mount point,
//! measured with `statvfs`) is at least `high` percent full, images no
//! container uses (running or exited), not pinned (by the runtime, or named
//! in the policy) and first seen at least `min_age` ago are removed, least
//! recently used first, until `capacity × (100 − low)% − available` bytes are
//! freed. "Used" is when the provider last saw a container of the image.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use kubelet_api::cri::v1 as cri;
use kubelet_provider::{
    ContainerGcReport, ContainerId, ImageGcPolicy, ImageGcReport, ProviderError, ProviderErrorKind,
};

use crate::{CONTAINER_NAME_LABEL, CriProvider, POD_UID_LABEL, describe, other};

/// When the provider first saw each image and last saw it used.
#[derive(Debug, Default)]
pub(crate) struct ImageRecords {
    seen: HashMap<String, (Instant, Instant)>,
}

impl CriProvider {
    /// Every container the runtime has, in any state.
    async fn all_containers(&self) -> Result<Vec<cri::Container>, ProviderError> {
        let mut runtime = self.runtime().await?;
        let answer = self
            .call(runtime.list_containers(cri::ListContainersRequest { filter: None }))
            .await
            .map_err(|s| other("ListContainers", &s))?;
        Ok(answer.containers)
    }

    pub(crate) async fn remove_exited(&self, keep: usize) -> Result<ContainerGcReport, ProviderError> {
        let mut groups: HashMap<(String, String), Vec<cri::Container>> = HashMap::new();
        for container in self.all_containers().await? {
            if container.state != cri::ContainerState::ContainerExited as i32 {
                continue;
            }
            let (Some(uid), Some(name)) =
                (container.labels.get(POD_UID_LABEL).cloned(), container.labels.get(CONTAINER_NAME_LABEL).cloned())
            else {
                continue;
            };
            groups.entry((uid, name)).or_default().push(container);
        }
        let mut report = ContainerGcReport::default();
        for ((uid, name), mut exited) in groups {
            exited.sort_by_key(|c| std::cmp::Reverse(c.created_at));
            for container in exited.into_iter().skip(keep) {
                let log = self.status(&container.id).await.ok().map(|s| s.log_path).filter(|p| !p.is_empty());
                let mut runtime = self.runtime().await?;
                let request = cri::RemoveContainerRequest { container_id: container.id.clone() };
                match self.call(runtime.remove_container(request)).await {
                    Ok(_) => {}
                    Err(s) if s.code() == tonic::Code::NotFound => continue,
                    Err(s) => return Err(other("RemoveContainer", &s)),
                }
                if let Some(log) = log {
                    remove_log_files(std::path::Path::new(&log));
                }
                tracing::info!(pod.uid = %uid, container = %name, id = %container.id, "exited container removed");
                report.removed.push(ContainerId(container.id));
            }
        }
        Ok(report)
    }

    pub(crate) async fn remove_unused_images(
        &self,
        policy: &ImageGcPolicy,
        all_unused: bool,
    ) -> Result<ImageGcReport, ProviderError> {
        let mut images = self.images().await?;
        let listed = self
            .call(images.list_images(cri::ListImagesRequest { filter: None }))
            .await
            .map_err(|s| other("ListImages", &s))?
            .images;
        let in_use: HashSet<String> = self
            .all_containers()
            .await?
            .into_iter()
            .flat_map(|c| [c.image_ref, c.image.map(|i| i.image).unwrap_or_default()])
            .filter(|r| !r.is_empty())
            .collect();
        // The runtime's sandbox image is never collected (containerd says
        // which it is in its verbose status; the policy may name it too).
        let sandbox_image = self.sandbox_image().await;
        let now = Instant::now();
        let used = |image: &cri::Image| {
            in_use.contains(&image.id) || image.repo_tags.iter().chain(&image.repo_digests).any(|r| in_use.contains(r))
        };
        let pinned = |image: &cri::Image| {
            image.pinned
                || image
                    .repo_tags
                    .iter()
                    .chain(&image.repo_digests)
                    .any(|r| policy.pinned.iter().chain(&sandbox_image).any(|p| same_image(p, r)))
        };
        let mut candidates = Vec::new();
        {
            let mut records = self.inner.images.lock().unwrap_or_else(|p| p.into_inner());
            records.seen.retain(|id, _| listed.iter().any(|i| &i.id == id));
            for image in &listed {
                let record = records.seen.entry(image.id.clone()).or_insert((now, now));
                if used(image) {
                    record.1 = now;
                    continue;
                }
                if pinned(image) || now.duration_since(record.0) < policy.min_age {
                    continue;
                }
                candidates.push((record.1, record.0, image.clone()));
            }
        }
        let wanted = if all_unused {
            u64::MAX
        } else {
            let (capacity, available) = self.image_fs_usage().await?;
            if capacity == 0 {
                return Err(ProviderError::new(ProviderErrorKind::Other, "invalid capacity 0 on image filesystem"));
            }
            let usage_percent = 100 - available.saturating_mul(100) / capacity;
            if usage_percent < u64::from(policy.high_threshold_percent) || policy.high_threshold_percent >= 100 {
                return Ok(ImageGcReport::default());
            }
            (capacity * (100 - u64::from(policy.low_threshold_percent)) / 100).saturating_sub(available)
        };
        // Least recently used first; then first seen.
        candidates.sort_by_key(|(last_used, first_seen, _)| (*last_used, *first_seen));
        let mut report = ImageGcReport { wanted: if all_unused { 0 } else { wanted }, ..ImageGcReport::default() };
        for (_, _, image) in candidates {
            if report.freed >= wanted {
                break;
            }
            let spec = cri::ImageSpec { image: image.id.clone(), ..Default::default() };
            match self.call(images.remove_image(cri::RemoveImageRequest { image: Some(spec) })).await {
                Ok(_) => {}
                Err(s) if s.code() == tonic::Code::NotFound => continue,
                Err(s) => {
                    tracing::warn!(image = %image.id, error = %describe(&s), "RemoveImage failed");
                    continue;
                }
            }
            tracing::info!(image = %image.id, tags = ?image.repo_tags, size = image.size, "unused image removed");
            self.inner.images.lock().unwrap_or_else(|p| p.into_inner()).seen.remove(&image.id);
            report.freed += image.size;
            report.removed.push(image.id);
        }
        Ok(report)
    }

    /// The sandbox image of the runtime's configuration (containerd's
    /// `sandboxImage`, in `Status` verbose's `config`), if it says.
    async fn sandbox_image(&self) -> Option<String> {
        self.runtime_config().await?.get("sandboxImage")?.as_str().map(str::to_owned)
    }

    /// The runtime's configuration, as `Status` verbose's `config` tells
    /// it (containerd's CRI plugin config), if it does.
    pub(crate) async fn runtime_config(&self) -> Option<serde_json::Value> {
        let mut runtime = self.runtime().await.ok()?;
        let status = self.call(runtime.status(cri::StatusRequest { verbose: true })).await.ok()?;
        serde_json::from_str(status.info.get("config")?).ok()
    }

    /// The image file system's capacity and available bytes.
    async fn image_fs_usage(&self) -> Result<(u64, u64), ProviderError> {
        use kubelet_provider::Provider as _;
        let path = self
            .image_fs_path()
            .await
            .ok_or_else(|| ProviderError::new(ProviderErrorKind::Other, "the runtime reports no image file system"))?;
        let stats = rustix::fs::statvfs(&path)
            .map_err(|e| ProviderError::new(ProviderErrorKind::Other, format!("statvfs {}: {e}", path.display())))?;
        Ok((stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize))
    }
}

/// Whether two image references name the same image (`pause:3.9` and
/// `registry.k8s.io/pause:3.9`, `docker.io/library/x` and `x`).
fn same_image(a: &str, b: &str) -> bool {
    let normal = |r: &str| {
        let r = r.strip_prefix("docker.io/").unwrap_or(r);
        r.strip_prefix("library/").unwrap_or(r).to_owned()
    };
    normal(a) == normal(b)
}

/// Removes `log` and what a rotation made of it (`<log>.*`).
fn remove_log_files(log: &std::path::Path) {
    let Some(dir) = log.parent() else { return };
    let Some(name) = log.file_name().and_then(|n| n.to_str()) else { return };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(file) = file.to_str() else { continue };
        if (file == name || file.starts_with(&format!("{name}.")))
            && let Err(error) = std::fs::remove_file(entry.path())
        {
            tracing::warn!(file = %entry.path().display(), %error, "cannot remove a removed container's log");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_names_match_across_spellings() {
        assert!(same_image("docker.io/library/busybox:1", "busybox:1"));
        assert!(same_image("registry.k8s.io/pause:3.9", "registry.k8s.io/pause:3.9"));
        assert!(!same_image("registry.k8s.io/pause:3.9", "registry.k8s.io/pause:3.8"));
    }
}
