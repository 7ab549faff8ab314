//! The volume reconciler: the node's volumes as desired (the pods it runs)
//! against what is actually on the host (pod directories under
//! `<root>/pods`, the volumes recorded in them, and the mounts listed in
//! `/proc/self/mountinfo`), brought together and kept together.
//!
//! A pod the node runs owns its volumes: its lifecycle prepares them
//! (adopting, after a restart, a CSI volume an earlier run published, unless
//! `mountinfo` shows its mount is gone: then it is published again) and
//! tears them down when it is removed, retrying until every one is. What no
//! running pod owns is the reconciler's: a pod directory left by an earlier
//! run for a pod no source knows any more. For each, the reconciler
//! reconstructs the volumes from what is on disk (a CSI volume from its
//! `vol_data.json`, emptyDir, downward API, configMap, secret and projected
//! volumes from their plugin directories) and tears them down: CSI volumes
//! through their driver (unpublished, and unstaged once nothing else uses
//! them), tmpfs mounts unmounted, then the directory removed. Nothing is
//! ever removed across a mount point. A step that fails (the driver has not
//! registered again, NodeUnpublishVolume fails, something unknown is still
//! mounted) is retried with jittered, doubling delays, and at once when a
//! CSI driver registers, until it succeeds; until then the pod counts as
//! holding something on the node (its deletion in the API waits).
//!
//! It starts once every pod source has listed its pods (before that, every
//! pod would look orphaned) and then runs for the node's lifetime, looking
//! again when a driver registers, when a retry is due, and every
//! [`RESYNC`] as a safety net.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::csi::{CSI_PLUGIN_DIR, CsiMount};
use super::{PodVolumes, PreparedVolume, VolumeKind, VolumeManager};
use crate::retry::RetryBackoff;

/// How often the reconciler looks again with nothing announcing a change.
pub(crate) const RESYNC: Duration = Duration::from_secs(30);

/// The plugin directories of volumes the node removes itself (after
/// unmounting a tmpfs it mounted there).
const OWN_PLUGIN_DIRS: [(&str, VolumeKind); 5] = [
    ("kubernetes.io~empty-dir", VolumeKind::EmptyDir),
    ("kubernetes.io~downward-api", VolumeKind::DownwardApi),
    ("kubernetes.io~configmap", VolumeKind::ApiData),
    ("kubernetes.io~secret", VolumeKind::ApiData),
    ("kubernetes.io~projected", VolumeKind::ApiData),
];

/// The reconciler's metrics (`/metrics`).
#[derive(Clone, Debug, Default)]
pub struct ReconcilerMetrics {
    orphaned: Gauge,
    errors: Counter,
    released: Counter,
}

impl ReconcilerMetrics {
    /// Registers `rustlet_volume_orphaned_pods` (pods whose leftovers are
    /// still being released), `rustlet_volume_orphan_teardown_errors_total`
    /// and `rustlet_volume_orphans_released_total`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "rustlet_volume_orphaned_pods",
            "Pods no source knows whose volumes or directory are still on the node",
            self.orphaned.clone(),
        );
        registry.register(
            "rustlet_volume_orphan_teardown_errors_total",
            "Failed attempts to release what a removed pod left on the node (each is retried)",
            self.errors.clone(),
        );
        registry.register(
            "rustlet_volume_orphans_released_total",
            "Removed pods whose volumes and directory the reconciler released",
            self.released.clone(),
        );
    }
}

/// The pod UIDs with a directory under `<root>/pods`.
pub(crate) fn pod_dirs(root_dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(root_dir.join("pods"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// The volumes of pod `uid` as its directory records them, ready for
/// [`VolumeManager::teardown`]. A CSI volume directory without its
/// `vol_data.json` is left to the directory's removal (which refuses to
/// cross a mount), as are plugin directories the node does not know.
pub(crate) fn reconstruct(root_dir: &Path, uid: &str) -> PodVolumes {
    let volumes_dir = root_dir.join("pods").join(uid).join("volumes");
    let mut found = PodVolumes::new();
    let mut add = |plugin: &str, name: String, volume: PreparedVolume| {
        let key = if found.contains_key(&name) { format!("{plugin}/{name}") } else { name };
        found.insert(key, volume);
    };
    for (name, dir) in entries(&volumes_dir.join(CSI_PLUGIN_DIR)) {
        let Ok(bytes) = std::fs::read(dir.join("vol_data.json")) else { continue };
        let Ok(mount) = serde_json::from_slice::<CsiMount>(&bytes) else { continue };
        let host_path = if mount.block {
            super::csi::block_publish_path(root_dir, &mount.spec_vol_id, uid)
        } else {
            dir.join("mount")
        };
        let volume = PreparedVolume { host_path, kind: VolumeKind::Csi, ready: false, csi: Some(mount) };
        add(CSI_PLUGIN_DIR, name, volume);
    }
    for (plugin, kind) in OWN_PLUGIN_DIRS {
        for (name, dir) in entries(&volumes_dir.join(plugin)) {
            add(plugin, name, PreparedVolume::ready(dir, kind));
        }
    }
    found
}

fn entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut found: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    found.sort();
    found
}

/// Releases what pods no source knows left on the node; see the module
/// docs.
pub(crate) struct Reconciler {
    volumes: VolumeManager,
    root_dir: PathBuf,
    initial: Duration,
    max: Duration,
    metrics: ReconcilerMetrics,
}

/// One orphan's retry schedule and its last failure.
struct Retry {
    backoff: RetryBackoff,
    due: Instant,
    error: String,
}

/// Where the release of what removed pods left stands.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// The pods no source knows whose volumes or directory are still on
    /// the node, each with why the last attempt failed (empty before the
    /// first attempt).
    pub pending: BTreeMap<String, String>,
    /// Passes the reconciler has made.
    pub passes: u64,
}

impl Reconciler {
    /// Tears down through `volumes`, under `root_dir`; failed attempts are
    /// retried after `initial`, doubling up to `max` (with jitter).
    pub(crate) fn new(
        volumes: VolumeManager,
        root_dir: impl Into<PathBuf>,
        initial: Duration,
        max: Duration,
        metrics: ReconcilerMetrics,
    ) -> Self {
        Reconciler { volumes, root_dir: root_dir.into(), initial, max, metrics }
    }

    /// The pods with a directory on disk that `live` (the pods the node
    /// runs, read *after* the directories, so that a pod applied in
    /// between, whose directory did not exist yet, is never taken for an
    /// orphan) does not hold.
    pub(crate) fn orphans(&self, live: impl FnOnce() -> HashSet<String>) -> BTreeSet<String> {
        let on_disk = pod_dirs(&self.root_dir);
        let live = live();
        on_disk.into_iter().filter(|uid| !live.contains(uid)).collect()
    }

    /// Before anything is torn down: the staged CSI volumes that running
    /// pods' published volumes use are marked in use by them, so that an
    /// orphan sharing a staged volume with a pod that has not adopted its
    /// volume yet never unstages it.
    pub(crate) async fn hold_staged_for(&self, live: &HashSet<String>) {
        let Some(csi) = self.volumes.csi() else { return };
        for uid in live {
            for volume in reconstruct(&self.root_dir, uid).values() {
                if let Some(mount) = &volume.csi {
                    csi.hold_staged(uid, mount).await;
                }
            }
        }
    }

    /// Runs until `shutdown`: each pass finds the orphans (`live` is asked
    /// each time), releases those whose retry is due, and tells `pending`
    /// which are still left, with their last error (a pod leaves that set
    /// only once everything it left is released).
    pub(crate) async fn run(
        self,
        live: impl Fn() -> HashSet<String> + Send,
        pending: impl Fn(&BTreeMap<String, String>) + Send,
        shutdown: CancellationToken,
    ) {
        let mut changes = self.volumes.changes();
        let mut retries: HashMap<String, Retry> = HashMap::new();
        loop {
            if let Some(changes) = changes.as_mut() {
                changes.mark_unchanged();
            }
            let orphans = self.orphans(&live);
            retries.retain(|uid, _| orphans.contains(uid));
            for uid in &orphans {
                if retries.get(uid).is_some_and(|r| r.due > Instant::now()) {
                    continue;
                }
                if live().contains(uid) {
                    continue;
                }
                match self.release(uid).await {
                    Ok(()) => {
                        retries.remove(uid);
                        self.metrics.released.inc();
                        tracing::info!(pod.uid = %uid, "released what a removed pod left on the node");
                    }
                    Err(reasons) => {
                        self.metrics.errors.inc();
                        let retry = retries.entry(uid.clone()).or_insert_with(|| Retry {
                            backoff: RetryBackoff::new(self.initial, self.max),
                            due: Instant::now(),
                            error: String::new(),
                        });
                        let delay = retry.backoff.next_delay();
                        retry.due = Instant::now() + delay;
                        retry.error = reasons.join("; ");
                        tracing::warn!(
                            pod.uid = %uid,
                            attempt = retry.backoff.failures(),
                            errors = %reasons.join("; "),
                            retry_in = ?delay,
                            "what a removed pod left on the node is not released yet; retrying"
                        );
                    }
                }
            }
            let left: BTreeMap<String, String> =
                orphans.into_iter().filter_map(|uid| retries.get(&uid).map(|r| (uid, r.error.clone()))).collect();
            self.metrics.orphaned.set(i64::try_from(left.len()).unwrap_or(i64::MAX));
            pending(&left);
            let resync = Instant::now() + RESYNC;
            let wake = retries.values().map(|r| r.due).min().map_or(resync, |due| due.min(resync));
            let registered = async {
                match changes.as_mut() {
                    Some(changes) => {
                        if changes.changed().await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(wake) => {}
                () = registered => {
                    // A driver came (or went): whoever waits for one tries
                    // again now.
                    for retry in retries.values_mut() {
                        retry.due = Instant::now();
                    }
                }
            }
        }
    }

    /// Tears down every volume pod `uid` left, then removes its directory.
    async fn release(&self, uid: &str) -> Result<(), Vec<String>> {
        let mut volumes = reconstruct(&self.root_dir, uid);
        for (name, volume) in &volumes {
            tracing::info!(pod.uid = %uid, volume = %name, kind = ?volume.kind, "tearing down a volume of a removed pod");
        }
        let errors = self.volumes.teardown(uid, &mut volumes).await;
        if errors.is_empty() { Ok(()) } else { Err(errors.iter().map(ToString::to_string).collect()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_volumes_are_reconstructed_from_its_directory() {
        let root = tempfile::tempdir().expect("tempdir");
        let volumes = root.path().join("pods/u1/volumes");
        let csi = volumes.join(CSI_PLUGIN_DIR).join("data");
        std::fs::create_dir_all(csi.join("mount")).expect("mkdir");
        let mount = CsiMount {
            driver_name: "d.example.com".into(),
            volume_handle: "h1".into(),
            spec_vol_id: "data".into(),
            volume_lifecycle_mode: "Ephemeral".into(),
            staging_target_path: None,
            block: false,
        };
        std::fs::write(csi.join("vol_data.json"), serde_json::to_vec(&mount).expect("json")).expect("write");
        // A CSI directory without its record, and an emptyDir with the
        // same name as the CSI volume.
        std::fs::create_dir_all(volumes.join(CSI_PLUGIN_DIR).join("half")).expect("mkdir");
        std::fs::create_dir_all(volumes.join("kubernetes.io~empty-dir/data")).expect("mkdir");
        std::fs::create_dir_all(volumes.join("kubernetes.io~secret/token")).expect("mkdir");
        let found = reconstruct(root.path(), "u1");
        let kinds: Vec<(&str, VolumeKind)> = found.iter().map(|(k, v)| (k.as_str(), v.kind)).collect();
        assert_eq!(
            kinds,
            [
                ("data", VolumeKind::Csi),
                ("kubernetes.io~empty-dir/data", VolumeKind::EmptyDir),
                ("token", VolumeKind::ApiData)
            ]
        );
        assert_eq!(found["data"].csi.as_ref(), Some(&mount));
        assert_eq!(found["data"].host_path, csi.join("mount"));
        assert_eq!(pod_dirs(root.path()), BTreeSet::from(["u1".to_owned()]));
    }

    #[tokio::test]
    async fn orphans_are_the_directories_no_live_pod_holds_and_are_removed() {
        let root = tempfile::tempdir().expect("tempdir");
        for uid in ["live", "gone"] {
            std::fs::create_dir_all(root.path().join("pods").join(uid).join("volumes/kubernetes.io~empty-dir/x"))
                .expect("mkdir");
        }
        let reconciler = Reconciler::new(
            VolumeManager::new(root.path()),
            root.path(),
            Duration::from_millis(10),
            Duration::from_millis(100),
            ReconcilerMetrics::default(),
        );
        let live = || HashSet::from(["live".to_owned()]);
        assert_eq!(reconciler.orphans(live), BTreeSet::from(["gone".to_owned()]));
        reconciler.release("gone").await.expect("released");
        assert!(!root.path().join("pods/gone").exists());
        assert!(root.path().join("pods/live/volumes/kubernetes.io~empty-dir/x").exists());
        assert!(reconciler.orphans(live).is_empty());
    }
}
