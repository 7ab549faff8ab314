//! Volume stats of the pods' persistent volume claims, as the kubelet
//! measures them: refreshed every `--volume-stats-agg-period` (upstream's
//! default: a minute) and served from that cache, on `/metrics` as
//! `kubelet_volume_stats_{capacity,available,used}_bytes` and
//! `kubelet_volume_stats_inodes{,_free,_used}` (labels `namespace`,
//! `persistentvolumeclaim`; one series per claim even when several pods
//! mount it) and in `/stats/summary`'s `volume` lists.
//!
//! A claim's figures come from its CSI driver's `NodeGetVolumeStats` when
//! the driver has the `GET_VOLUME_STATS` capability, else from `statvfs` of
//! the path the containers mount. Only claims (`persistentVolumeClaim`
//! volumes, and generic ephemeral volumes' `<pod>-<volume>` claims) are
//! listed, as upstream lists them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubelet_support::metrics::ScrapeFamily;
use prometheus_client::registry::Registry;

use super::{CsiMount, PodVolumes};

/// Upstream's `--volume-stats-agg-period`.
pub const DEFAULT_PERIOD: Duration = Duration::from_secs(60);

/// One claim volume a pod mounts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimVolume {
    /// The pod's namespace.
    pub namespace: String,
    /// The claim's name.
    pub claim: String,
    /// The pod's volume name.
    pub volume: String,
    /// What the containers mount.
    pub host_path: PathBuf,
    /// The CSI volume behind it, if any.
    pub csi: Option<CsiMount>,
}

/// One claim volume's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimUsage {
    /// The volume.
    pub volume: ClaimVolume,
    /// When they were measured.
    pub time: jiff::Timestamp,
    /// Bytes the file system holds.
    pub capacity: u64,
    /// Bytes free to the pod.
    pub available: u64,
    /// Bytes used.
    pub used: u64,
    /// Inodes.
    pub inodes: u64,
    /// Free inodes.
    pub inodes_free: u64,
    /// Used inodes.
    pub inodes_used: u64,
}

/// The pods' claim volumes and their last figures. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct VolumeStats {
    /// Claim volumes by pod UID (what the pods mount now).
    mounted: Arc<Mutex<BTreeMap<String, Vec<ClaimVolume>>>>,
    /// The last figures, by pod UID.
    usage: Arc<Mutex<BTreeMap<String, Vec<ClaimUsage>>>>,
    /// Wakes the refresher when a pod mounts a claim (its figures are
    /// measured at once rather than a period later).
    mounted_changed: Arc<tokio::sync::Notify>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The claim each volume of `pod` names (`persistentVolumeClaim`, or a
/// generic ephemeral volume's `<pod>-<volume>`), by volume name.
fn claims_of(pod: &Pod) -> BTreeMap<String, String> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| Some((v.name.clone(), super::csi::claim_source(pod, v)?.claim_name)))
        .collect()
}

impl VolumeStats {
    /// `pod`'s volumes are prepared as `prepared`: its ready claim volumes
    /// are followed from now on.
    pub(crate) fn mounted(&self, pod: &Pod, prepared: &PodVolumes) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let namespace = pod.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let claims: Vec<ClaimVolume> = claims_of(pod)
            .into_iter()
            .filter_map(|(volume, claim)| {
                let prepared = prepared.get(&volume).filter(|p| p.ready)?;
                Some(ClaimVolume {
                    namespace: namespace.clone(),
                    claim,
                    volume,
                    host_path: prepared.host_path.clone(),
                    csi: prepared.csi.clone(),
                })
            })
            .collect();
        if claims.is_empty() {
            return;
        }
        lock(&self.mounted).insert(uid, claims);
        self.mounted_changed.notify_one();
    }

    /// Pod `uid`'s volumes are torn down.
    pub(crate) fn unmounted(&self, uid: &str) {
        lock(&self.mounted).remove(uid);
        lock(&self.usage).remove(uid);
    }

    /// Pod `uid`'s claim volumes' last figures (`/stats/summary`).
    pub fn pod_usage(&self, uid: &str) -> Vec<ClaimUsage> {
        lock(&self.usage).get(uid).cloned().unwrap_or_default()
    }

    /// Each claim's last figures, once per claim.
    fn by_claim(&self) -> Vec<ClaimUsage> {
        let usage = lock(&self.usage);
        let mut seen = BTreeSet::new();
        usage
            .values()
            .flatten()
            .filter(|u| seen.insert((u.volume.namespace.clone(), u.volume.claim.clone())))
            .cloned()
            .collect()
    }

    /// Registers the `kubelet_volume_stats_*` series into `registry`.
    pub fn register(&self, registry: &mut Registry) {
        type Read = fn(&ClaimUsage) -> u64;
        let families: [(&'static str, &'static str, Read); 6] = [
            ("kubelet_volume_stats_capacity_bytes", "[ALPHA] Capacity in bytes of the volume", |u| u.capacity),
            ("kubelet_volume_stats_available_bytes", "[ALPHA] Number of available bytes in the volume", |u| {
                u.available
            }),
            ("kubelet_volume_stats_used_bytes", "[ALPHA] Number of used bytes in the volume", |u| u.used),
            ("kubelet_volume_stats_inodes", "[ALPHA] Maximum number of inodes in the volume", |u| u.inodes),
            ("kubelet_volume_stats_inodes_free", "[ALPHA] Number of free inodes in the volume", |u| u.inodes_free),
            ("kubelet_volume_stats_inodes_used", "[ALPHA] Number of used inodes in the volume", |u| u.inodes_used),
        ];
        for (name, help, read) in families {
            let stats = self.clone();
            registry.register_collector(ScrapeFamily::gauge(
                name,
                help,
                &["namespace", "persistentvolumeclaim"],
                move || {
                    stats
                        .by_claim()
                        .into_iter()
                        .map(|u| (vec![u.volume.namespace.clone(), u.volume.claim.clone()], read(&u) as f64))
                        .collect()
                },
            ));
        }
    }

    /// Measures every mounted claim volume now.
    pub(crate) async fn refresh(&self, csi: Option<&super::CsiVolumes>) {
        let mounted = lock(&self.mounted).clone();
        let mut fresh = BTreeMap::new();
        for (uid, volumes) in mounted {
            let mut measured = Vec::new();
            for volume in volumes {
                match measure(&volume, csi).await {
                    Ok(usage) => measured.push(usage),
                    Err(error) => tracing::debug!(
                        pod.uid = %uid,
                        volume = %volume.volume,
                        claim = %volume.claim,
                        %error,
                        "volume stats unavailable"
                    ),
                }
            }
            fresh.insert(uid, measured);
        }
        // Pods unmounted while this ran stay gone.
        let still = lock(&self.mounted);
        fresh.retain(|uid, _| still.contains_key(uid));
        *lock(&self.usage) = fresh;
    }

    /// Refreshes the figures every `period` (and when a pod mounts a
    /// claim) until `shutdown`.
    pub(crate) async fn run(
        self,
        csi: Option<super::CsiVolumes>,
        period: Duration,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        loop {
            self.refresh(csi.as_ref()).await;
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(period) => {}
                () = self.mounted_changed.notified() => {}
            }
        }
    }
}

/// One volume's figures: its CSI driver's, else `statvfs`'s.
async fn measure(volume: &ClaimVolume, csi: Option<&super::CsiVolumes>) -> Result<ClaimUsage, String> {
    let time = jiff::Timestamp::now();
    if let (Some(mount), Some(csi)) = (&volume.csi, csi)
        && let Some(usage) =
            csi.volume_usage(&volume.volume, mount, &volume.host_path).await.map_err(|e| e.to_string())?
    {
        let (capacity, available, used) = usage.bytes.ok_or("the driver reported no byte usage")?;
        let (inodes, inodes_free, inodes_used) = usage.inodes.unwrap_or_default();
        return Ok(ClaimUsage {
            volume: volume.clone(),
            time,
            capacity,
            available,
            used,
            inodes,
            inodes_free,
            inodes_used,
        });
    }
    let stats =
        rustix::fs::statvfs(&volume.host_path).map_err(|e| format!("statvfs {}: {e}", volume.host_path.display()))?;
    let size = stats.f_frsize;
    Ok(ClaimUsage {
        volume: volume.clone(),
        time,
        capacity: stats.f_blocks.saturating_mul(size),
        available: stats.f_bavail.saturating_mul(size),
        used: stats.f_blocks.saturating_sub(stats.f_bfree).saturating_mul(size),
        inodes: stats.f_files,
        inodes_free: stats.f_ffree,
        inodes_used: stats.f_files.saturating_sub(stats.f_ffree),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume::{PreparedVolume, VolumeKind};

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "db", "namespace": "shop", "uid": "u1"},
            "spec": {"containers": [], "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": "db-data"}},
                {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
                {"name": "tmp", "emptyDir": {}}
            ]}
        }))
        .expect("a pod")
    }

    #[tokio::test]
    async fn claims_are_measured_by_statvfs_without_a_driver_and_listed_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let prepared: PodVolumes = ["data", "scratch", "tmp"]
            .into_iter()
            .map(|name| (name.to_owned(), PreparedVolume::ready(dir.path().to_owned(), VolumeKind::HostPath)))
            .collect();
        let stats = VolumeStats::default();
        stats.mounted(&pod(), &prepared);
        stats.refresh(None).await;
        let usage = stats.pod_usage("u1");
        let claims: Vec<&str> = usage.iter().map(|u| u.volume.claim.as_str()).collect();
        assert_eq!(claims, ["db-data", "db-scratch"]);
        let expected = rustix::fs::statvfs(dir.path()).expect("statvfs");
        assert_eq!(usage[0].capacity, expected.f_blocks * expected.f_frsize);
        assert_eq!(usage[0].inodes, expected.f_files);
        let mut registry = Registry::default();
        stats.register(&mut registry);
        let text = kubelet_support::metrics::encode_text(&registry).expect("encodes");
        assert!(
            text.contains("kubelet_volume_stats_capacity_bytes{namespace=\"shop\",persistentvolumeclaim=\"db-data\"}"),
            "{text}"
        );
        stats.unmounted("u1");
        assert!(stats.pod_usage("u1").is_empty());
        assert!(!kubelet_support::metrics::encode_text(&registry).expect("encodes").contains("db-data"));
    }
}
