//! Static pods: the pods of a manifest directory (the kubelet's
//! `--pod-manifest-path`), added, changed and removed as its files change.
//!
//! - Every file not starting with `.` is read as YAML or JSON, one document
//!   or several (`---`). A `Pod` document becomes a pod; a `CSIDriver`
//!   document (`storage.k8s.io/v1`) tells the node how to treat that driver
//!   (`podInfoOnMount`, `volumeLifecycleModes`), as the API's CSIDriver
//!   objects do in a cluster.
//! - As upstream: the pod's name gets the node name as a suffix
//!   (`<name>-<node>`), the namespace defaults to `default`, and a pod without
//!   a UID gets one hashed from its decoded manifest, the node name and the
//!   file's path, so the same manifest keeps its UID across restarts (and a
//!   changed manifest is a new pod: the old one is removed, the new one
//!   started). Annotations `kubernetes.io/config.source: file`,
//!   `kubernetes.io/config.hash` and `kubernetes.io/config.seen` are set.
//! - Event-driven (inotify on the directory), with a full rescan every
//!   `rescan_period` (upstream's 20 s) as a safety net.
//! - Bad input never stops the others: a file that is not YAML/JSON, or
//!   holds something that is not a valid Pod, is reported with its path
//!   ([`StaticPods::errors`] and the log) and its pods keep running as they
//!   were (a half-written save does not remove a pod). A second pod with the
//!   full name of a pod from another file is refused, naming both files.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inotify::{Inotify, WatchMask};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::storage::v1::CSIDriverSpec;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::pod::Pods;
use crate::volume::CsiDriverObjects;

/// Where static pods come from.
#[derive(Clone, Debug)]
pub struct StaticPodConfig {
    /// The manifest directory.
    pub dir: PathBuf,
    /// The node's name (the pods' name suffix and part of their UID).
    pub node_name: String,
    /// Period of the full rescan (upstream: 20 s).
    pub rescan_period: Duration,
}

impl StaticPodConfig {
    /// Upstream's rescan period for `dir`.
    pub fn new(dir: impl Into<PathBuf>, node_name: impl Into<String>) -> Self {
        StaticPodConfig { dir: dir.into(), node_name: node_name.into(), rescan_period: Duration::from_secs(20) }
    }
}

/// What one manifest document is.
#[derive(Clone, Debug)]
pub(crate) enum ManifestObject {
    /// A static pod, named, UID'd and annotated for this node.
    Pod(Box<Pod>),
    /// A `CSIDriver` object.
    CsiDriver {
        /// The driver's name.
        name: String,
        /// Its spec.
        spec: CSIDriverSpec,
    },
}

/// Why a manifest file yields no objects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ManifestError {
    /// The file starts like JSON and is not.
    #[error("not valid JSON: {0}")]
    Json(String),
    /// The file is not YAML.
    #[error("not valid YAML: {0}")]
    Yaml(String),
    /// One of its documents is wrong (counted from 1).
    #[error("document {document}: {problem}")]
    Document {
        /// Which document.
        document: usize,
        /// What is wrong with it.
        problem: String,
    },
}

/// Reads the manifest file `path` (its text `text`) for node `node_name`.
/// Errors name the document and say what is wrong.
pub(crate) fn parse_manifest(path: &Path, text: &str, node_name: &str) -> Result<Vec<ManifestObject>, ManifestError> {
    let documents: Vec<Value> = if text.trim_start().starts_with('{') {
        vec![serde_json::from_str(text).map_err(|e| ManifestError::Json(e.to_string()))?]
    } else {
        serde_saphyr::from_multiple(text).map_err(|e| ManifestError::Yaml(e.to_string()))?
    };
    let mut objects = Vec::new();
    for (index, document) in documents.into_iter().enumerate() {
        if document.is_null() {
            continue;
        }
        let wrong = |problem: String| ManifestError::Document { document: index + 1, problem };
        let kind = document.get("kind").and_then(Value::as_str).unwrap_or_default().to_owned();
        match kind.as_str() {
            "Pod" => objects.push(ManifestObject::Pod(Box::new(static_pod(document, path, node_name).map_err(wrong)?))),
            "CSIDriver" => {
                let name = document
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| wrong("a CSIDriver needs metadata.name".into()))?
                    .to_owned();
                let spec = document.get("spec").cloned().unwrap_or(Value::Object(Default::default()));
                let spec: CSIDriverSpec =
                    serde_json::from_value(spec).map_err(|e| wrong(format!("not a valid CSIDriver spec: {e}")))?;
                objects.push(ManifestObject::CsiDriver { name, spec });
            }
            "" => return Err(wrong("no `kind` (expected kind: Pod)".into())),
            other => {
                return Err(wrong(format!("is a {other}, not a Pod (static manifests hold Pods and CSIDrivers)")));
            }
        }
    }
    Ok(objects)
}

/// A decoded Pod document made into this node's static pod.
fn static_pod(document: Value, path: &Path, node_name: &str) -> Result<Pod, String> {
    let mut hasher = Sha256::new();
    hasher.update(serde_json::to_vec(&document).map_err(|e| e.to_string())?);
    hasher.update(format!("host:{node_name}"));
    hasher.update(format!("file:{}", path.display()));
    let hash: String = hasher.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
    let mut pod: Pod = serde_json::from_value(document).map_err(|e| format!("not a valid Pod: {e}"))?;
    let meta = &mut pod.metadata;
    let name = meta.name.clone().filter(|n| !n.is_empty()).ok_or("a Pod needs metadata.name")?;
    meta.name = Some(format!("{name}-{}", node_name.to_lowercase()));
    if meta.namespace.as_deref().is_none_or(str::is_empty) {
        meta.namespace = Some("default".into());
    }
    if meta.uid.as_deref().is_none_or(str::is_empty) {
        meta.uid = Some(hash.clone());
    }
    let annotations = meta.annotations.get_or_insert_with(BTreeMap::new);
    annotations.insert("kubernetes.io/config.source".into(), "file".into());
    annotations.insert("kubernetes.io/config.hash".into(), meta.uid.clone().unwrap_or(hash));
    annotations.insert("kubernetes.io/config.seen".into(), jiff::Timestamp::now().to_string());
    let spec = pod.spec.as_mut().ok_or("a Pod needs a spec")?;
    spec.node_name = Some(node_name.to_owned());
    if spec.containers.is_empty() {
        return Err("a Pod needs at least one container".into());
    }
    let mut names = BTreeSet::new();
    for container in spec.init_containers.iter().flatten().chain(&spec.containers) {
        if container.name.is_empty() {
            return Err("every container needs a name".into());
        }
        if !names.insert(container.name.as_str()) {
            return Err(format!("container name {:?} is used twice", container.name));
        }
    }
    validate_names(&pod)?;
    validate_mount_propagation(&pod)?;
    Ok(pod)
}

/// Checks every volume mount's `mountPropagation` as the API server's
/// validation does (Bidirectional for privileged containers only).
fn validate_mount_propagation(pod: &Pod) -> Result<(), String> {
    let Some(spec) = pod.spec.as_ref() else { return Ok(()) };
    let lists =
        [("initContainers", spec.init_containers.as_deref().unwrap_or_default()), ("containers", &spec.containers)];
    for (list, containers) in lists {
        for (i, container) in containers.iter().enumerate() {
            // Upstream names the list, not the entry (`volumeMounts.mountPropagation`).
            for mount in container.volume_mounts.iter().flatten() {
                crate::pod::run_options::propagation(container, mount.mount_propagation.as_deref())
                    .map_err(|why| format!("spec.{list}[{i}].volumeMounts.{why}"))?;
            }
        }
    }
    Ok(())
}

/// Checks, as the API server's validation would, every name of `pod` that
/// becomes part of a path on the node (its name, namespace and UID in the
/// pod and log directories; volume and container names below them), so
/// that a manifest cannot name a directory outside the root dir.
fn validate_names(pod: &Pod) -> Result<(), String> {
    let meta = &pod.metadata;
    subdomain("metadata.name", meta.name.as_deref().unwrap_or_default())?;
    label("metadata.namespace", meta.namespace.as_deref().unwrap_or_default())?;
    let uid = meta.uid.as_deref().unwrap_or_default();
    let uid_ok = !uid.is_empty()
        && uid.len() <= 128
        && !uid.starts_with('.')
        && uid.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !uid_ok {
        return Err(format!(
            "metadata.uid: Invalid value: {uid:?}: must be at most 128 letters, digits, '-', '_' or '.', not starting with '.'"
        ));
    }
    let Some(spec) = pod.spec.as_ref() else { return Ok(()) };
    for (i, volume) in spec.volumes.iter().flatten().enumerate() {
        label(&format!("spec.volumes[{i}].name"), &volume.name)?;
    }
    for (i, container) in spec.init_containers.iter().flatten().enumerate() {
        label(&format!("spec.initContainers[{i}].name"), &container.name)?;
    }
    for (i, container) in spec.containers.iter().enumerate() {
        label(&format!("spec.containers[{i}].name"), &container.name)?;
    }
    Ok(())
}

/// A lowercase RFC 1123 label (upstream's text).
fn label(field: &str, value: &str) -> Result<(), String> {
    if is_label(value) {
        return Ok(());
    }
    Err(format!(
        "{field}: Invalid value: {value:?}: a lowercase RFC 1123 label must consist of lower case alphanumeric characters \
         or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for \
         validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
    ))
}

/// A lowercase RFC 1123 subdomain (upstream's text).
fn subdomain(field: &str, value: &str) -> Result<(), String> {
    if value.len() <= 253 && value.split('.').all(is_label) {
        return Ok(());
    }
    Err(format!(
        "{field}: Invalid value: {value:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
         characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used \
         for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
    ))
}

fn is_label(value: &str) -> bool {
    let bytes = value.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
}

/// What the node took from one file.
#[derive(Debug, Default)]
struct FileEntry {
    /// Pod UIDs and full names (`namespace/name`).
    pods: Vec<(String, String)>,
    /// CSIDriver names.
    drivers: Vec<String>,
}

#[derive(Default)]
struct SourceState {
    files: BTreeMap<PathBuf, FileEntry>,
    /// Pod full name → the file it came from.
    names: HashMap<String, PathBuf>,
    /// Problems, per file.
    errors: BTreeMap<PathBuf, String>,
}

/// The static pod source: applies the directory's pods to [`Pods`]. Cheap
/// to clone.
#[derive(Clone)]
pub struct StaticPods {
    config: Arc<StaticPodConfig>,
    pods: Pods,
    drivers: CsiDriverObjects,
    state: Arc<Mutex<SourceState>>,
    changes: Arc<tokio::sync::watch::Sender<u64>>,
}

impl StaticPods {
    /// Reads the directory once (every pod in it applied when this returns),
    /// then follows it until `shutdown`. The directory is created if missing.
    pub async fn start(
        config: StaticPodConfig,
        pods: Pods,
        drivers: CsiDriverObjects,
        shutdown: CancellationToken,
    ) -> std::io::Result<(StaticPods, JoinHandle<()>)> {
        std::fs::create_dir_all(&config.dir)?;
        let inotify = Inotify::init()?;
        let mask = WatchMask::CLOSE_WRITE
            | WatchMask::MOVED_TO
            | WatchMask::MOVED_FROM
            | WatchMask::DELETE
            | WatchMask::CREATE
            | WatchMask::ATTRIB
            | WatchMask::DELETE_SELF
            | WatchMask::MOVE_SELF;
        inotify.watches().add(&config.dir, mask)?;
        let events = inotify.into_event_stream(vec![0u8; 16 * 1024])?;
        let source = StaticPods {
            config: Arc::new(config),
            pods,
            drivers,
            state: Arc::default(),
            changes: Arc::new(tokio::sync::watch::channel(0).0),
        };
        source.rescan();
        tracing::info!(dir = %source.config.dir.display(), pods = source.state().files.values().map(|f| f.pods.len()).sum::<usize>(), "static pods read");
        // Not supervised here: returned to the node, which watches it (`static-pods`).
        let task = tokio::spawn(source.clone().follow(events, shutdown));
        Ok((source, task))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SourceState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The manifest problems, per file (empty when all is well).
    pub fn errors(&self) -> BTreeMap<PathBuf, String> {
        self.state().errors.clone()
    }

    /// Bumped after each file is processed (tests wait on it).
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    async fn follow(self, mut events: inotify::EventStream<Vec<u8>>, shutdown: CancellationToken) {
        let mut rescan = tokio::time::interval(self.config.rescan_period);
        rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        rescan.tick().await;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = rescan.tick() => self.rescan(),
                event = events.next() => match event {
                    Some(Ok(event)) => {
                        if event.mask.contains(inotify::EventMask::Q_OVERFLOW) {
                            tracing::warn!("static pod watch queue overflowed; rescanning");
                            self.rescan();
                        } else if event.mask.intersects(inotify::EventMask::DELETE_SELF | inotify::EventMask::MOVE_SELF) {
                            tracing::error!(dir = %self.config.dir.display(), "the static pod directory was removed; its pods are removed, and it is read again on the next rescan");
                            self.rescan();
                        } else if let Some(name) = event.name {
                            let path = self.config.dir.join(&name);
                            // CREATE matters for symlinks only: a file's content
                            // arrives with CLOSE_WRITE.
                            let symlink = path.symlink_metadata().is_ok_and(|m| m.file_type().is_symlink());
                            if !event.mask.contains(inotify::EventMask::CREATE) || symlink {
                                self.sync_file(&path);
                            }
                        }
                    }
                    Some(Err(error)) => {
                        tracing::error!(%error, "static pod watch failed; following the directory by rescans only");
                        loop {
                            tokio::select! {
                                () = shutdown.cancelled() => return,
                                _ = rescan.tick() => self.rescan(),
                            }
                        }
                    }
                    None => return,
                },
            }
        }
    }

    /// Reads every file; files gone since are removed.
    fn rescan(&self) {
        let mut present = BTreeSet::new();
        match std::fs::read_dir(&self.config.dir) {
            Ok(entries) => {
                let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
                paths.sort();
                for path in paths {
                    if is_manifest(&path) {
                        present.insert(path.clone());
                        self.sync_file(&path);
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, dir = %self.config.dir.display(), "cannot read the static pod directory")
            }
        }
        let gone: Vec<PathBuf> = self.state().files.keys().filter(|p| !present.contains(*p)).cloned().collect();
        for path in gone {
            self.sync_file(&path);
        }
    }

    /// Brings the node in line with one file (read again from disk).
    fn sync_file(&self, path: &Path) {
        if !is_manifest(path) && !self.state().files.contains_key(path) {
            return;
        }
        let objects = match std::fs::read(path) {
            Ok(_) if !is_manifest(path) => Ok(Vec::new()),
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(text) => parse_manifest(path, &text, &self.config.node_name).map_err(|e| e.to_string()),
                Err(_) => Err("not UTF-8 text".to_owned()),
            },
            // Gone (or now a directory): its pods go.
            Err(error) if matches!(error.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::IsADirectory) => {
                Ok(Vec::new())
            }
            Err(error) => Err(format!("cannot read: {error}")),
        };
        match objects {
            Ok(objects) => self.apply_file(path, objects),
            Err(error) => {
                let mut state = self.state();
                if state.errors.get(path) != Some(&error) {
                    tracing::error!(file = %path.display(), %error, "static pod manifest ignored; its pods (if any) are left as they were");
                }
                state.errors.insert(path.to_owned(), error);
            }
        }
        self.changes.send_modify(|n| *n += 1);
    }

    fn apply_file(&self, path: &Path, objects: Vec<ManifestObject>) {
        let mut state = self.state();
        let mut errors = Vec::new();
        let old = state.files.remove(path).unwrap_or_default();
        let mut entry = FileEntry::default();
        let mut to_apply = Vec::new();
        for object in objects {
            match object {
                ManifestObject::Pod(pod) => {
                    let uid = pod.metadata.uid.clone().unwrap_or_default();
                    let full_name = format!(
                        "{}/{}",
                        pod.metadata.namespace.as_deref().unwrap_or_default(),
                        pod.metadata.name.as_deref().unwrap_or_default()
                    );
                    let owner = state.names.get(&full_name).filter(|owner| owner.as_path() != path);
                    if let Some(owner) = owner {
                        errors.push(format!(
                            "pod {full_name} is already defined in {}; this one is ignored",
                            owner.display()
                        ));
                        continue;
                    }
                    if entry.pods.iter().any(|(_, n)| *n == full_name) {
                        errors.push(format!("pod {full_name} is defined twice in this file; the second is ignored"));
                        continue;
                    }
                    entry.pods.push((uid.clone(), full_name));
                    if !old.pods.iter().any(|(u, _)| *u == uid) {
                        to_apply.push(*pod);
                    }
                }
                ManifestObject::CsiDriver { name, spec } => {
                    self.drivers.set(&name, spec);
                    entry.drivers.push(name);
                }
            }
        }
        for (uid, full_name) in &old.pods {
            if !entry.pods.iter().any(|(u, _)| u == uid) {
                tracing::info!(file = %path.display(), pod = %full_name, pod.uid = %uid, "static pod removed");
                self.pods.delete(uid);
                state.names.remove(full_name);
            }
        }
        for name in &old.drivers {
            if !entry.drivers.contains(name) {
                self.drivers.remove(name);
            }
        }
        for (_, full_name) in &entry.pods {
            state.names.insert(full_name.clone(), path.to_owned());
        }
        if errors.is_empty() {
            state.errors.remove(path);
        } else {
            let error = errors.join("; ");
            tracing::error!(file = %path.display(), %error, "static pod manifest partly ignored");
            state.errors.insert(path.to_owned(), error);
        }
        if !entry.pods.is_empty() || !entry.drivers.is_empty() {
            state.files.insert(path.to_owned(), entry);
        }
        drop(state);
        for pod in to_apply {
            tracing::info!(file = %path.display(), pod = %pod.metadata.name.as_deref().unwrap_or_default(), pod.uid = %pod.metadata.uid.as_deref().unwrap_or_default(), "static pod added");
            self.pods.apply(pod);
        }
    }
}

/// Files the source reads: not hidden, not a directory.
fn is_manifest(path: &Path) -> bool {
    let hidden = path.file_name().and_then(|n| n.to_str()).is_none_or(|n| n.starts_with('.'));
    !hidden && std::fs::metadata(path).is_ok_and(|m| m.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods(objects: &[ManifestObject]) -> Vec<&Pod> {
        objects
            .iter()
            .filter_map(|o| match o {
                ManifestObject::Pod(p) => Some(&**p),
                ManifestObject::CsiDriver { .. } => None,
            })
            .collect()
    }

    const WEB: &str =
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\nspec:\n  containers:\n  - name: c\n    image: x\n";

    #[test]
    fn a_pod_gets_the_node_suffix_namespace_and_a_stable_uid() {
        let path = Path::new("/etc/pods/web.yaml");
        let first = parse_manifest(path, WEB, "Node-A").expect("parses");
        let pod = pods(&first)[0];
        assert_eq!(pod.metadata.name.as_deref(), Some("web-node-a"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("default"));
        let uid = pod.metadata.uid.clone().expect("uid");
        assert_eq!(uid.len(), 32);
        let annotations = pod.metadata.annotations.as_ref().expect("annotations");
        assert_eq!(annotations["kubernetes.io/config.source"], "file");
        assert_eq!(annotations["kubernetes.io/config.hash"], uid);
        assert_eq!(pod.spec.as_ref().and_then(|s| s.node_name.as_deref()), Some("Node-A"));
        let again = parse_manifest(path, WEB, "Node-A").expect("parses");
        assert_eq!(pods(&again)[0].metadata.uid, Some(uid.clone()), "same manifest, same UID");
        let json = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"web"},"spec":{"containers":[{"name":"c","image":"x"}]}}"#;
        let from_json = parse_manifest(path, json, "Node-A").expect("json parses");
        assert_eq!(pods(&from_json)[0].metadata.uid, Some(uid.clone()), "the decoded object is hashed, not the text");
        let elsewhere = parse_manifest(Path::new("/etc/pods/other.yaml"), WEB, "Node-A").expect("parses");
        assert_ne!(pods(&elsewhere)[0].metadata.uid, Some(uid.clone()), "the file is part of the UID");
        let changed = parse_manifest(path, &WEB.replace("image: x", "image: other"), "Node-A").expect("parses");
        assert_ne!(pods(&changed)[0].metadata.uid, Some(uid), "a changed manifest is a new pod");
    }

    #[test]
    fn several_documents_and_csi_drivers() {
        let text = format!(
            "{WEB}---\napiVersion: storage.k8s.io/v1\nkind: CSIDriver\nmetadata:\n  name: d.example.com\nspec:\n  podInfoOnMount: true\n  volumeLifecycleModes: [Ephemeral]\n---\n{}",
            WEB.replace("name: web", "name: api")
        );
        let objects = parse_manifest(Path::new("/m"), &text, "n").expect("parses");
        assert_eq!(objects.len(), 3);
        let ManifestObject::CsiDriver { name, spec } = &objects[1] else { panic!("a CSIDriver") };
        assert_eq!(name, "d.example.com");
        assert_eq!(spec.pod_info_on_mount, Some(true));
        assert_eq!(spec.volume_lifecycle_modes.as_deref(), Some(&["Ephemeral".to_owned()][..]));
    }

    #[test]
    fn bad_documents_say_what_is_wrong() {
        let p = Path::new("/m");
        assert!(matches!(parse_manifest(p, "kind: Pod\nmetadata: [", "n"), Err(ManifestError::Yaml(_))));
        assert!(parse_manifest(p, "{\"kind\": ", "n").expect_err("bad json").to_string().contains("not valid JSON"));
        let service = "apiVersion: v1\nkind: Service\nmetadata:\n  name: s\n";
        assert!(
            parse_manifest(p, service, "n").expect_err("not a pod").to_string().contains("is a Service, not a Pod")
        );
        assert!(parse_manifest(p, "a: 1\n", "n").expect_err("no kind").to_string().contains("no `kind`"));
        let nameless = "kind: Pod\nspec:\n  containers:\n  - name: c\n";
        assert!(parse_manifest(p, nameless, "n").expect_err("no name").to_string().contains("metadata.name"));
        let empty = "kind: Pod\nmetadata:\n  name: x\nspec:\n  containers: []\n";
        assert!(
            parse_manifest(p, empty, "n").expect_err("no containers").to_string().contains("at least one container")
        );
        let twice = "kind: Pod\nmetadata:\n  name: x\nspec:\n  containers:\n  - name: c\n  - name: c\n";
        assert!(parse_manifest(p, twice, "n").expect_err("dup").to_string().contains("used twice"));
        let typed = "kind: Pod\nmetadata:\n  name: x\nspec:\n  containers: 3\n";
        assert!(parse_manifest(p, typed, "n").expect_err("types").to_string().contains("not a valid Pod"));
        assert!(parse_manifest(p, "", "n").expect("empty file").is_empty());
    }

    #[test]
    fn names_that_become_paths_are_validated_before_anything_is_made() {
        let p = Path::new("/m");
        let pod = |meta: &str, volume: &str| {
            format!(
                "kind: Pod\nmetadata: {{{meta}}}\nspec:\n  containers:\n  - name: c\n  volumes:\n  - name: {volume:?}\n    emptyDir: {{}}\n"
            )
        };
        let error = parse_manifest(p, &pod("name: x", "/tmp/x"), "n").expect_err("a path as a volume name").to_string();
        assert!(
            error.contains("spec.volumes[0].name: Invalid value: \"/tmp/x\": a lowercase RFC 1123 label"),
            "{error}"
        );
        let error = parse_manifest(p, &pod("name: x, uid: /home", "v"), "n").expect_err("a path as a UID").to_string();
        assert!(error.contains("metadata.uid: Invalid value: \"/home\""), "{error}");
        let error = parse_manifest(p, &pod("name: x, uid: '..'", "v"), "n").expect_err("a parent as a UID").to_string();
        assert!(error.contains("metadata.uid"), "{error}");
        let error = parse_manifest(p, &pod("name: x, namespace: ../etc", "v"), "n").expect_err("namespace").to_string();
        assert!(error.contains("metadata.namespace: Invalid value"), "{error}");
        let error = parse_manifest(p, &pod("name: X_Y", "v"), "n").expect_err("name").to_string();
        assert!(error.contains("metadata.name: Invalid value: \"X_Y-n\": a lowercase RFC 1123 subdomain"), "{error}");
        assert_eq!(
            parse_manifest(p, &pod("name: web.v1, uid: abc-123_x.y", "data-1"), "Node-1").expect("valid").len(),
            1
        );
    }

    #[test]
    fn mount_propagation_is_checked_as_the_api_server_checks_it() {
        let p = Path::new("/m");
        let pod = |privileged: bool, mode: &str| {
            format!(
                "kind: Pod\nmetadata: {{name: x}}\nspec:\n  containers:\n  - name: c\n    image: i\n    \
                 securityContext: {{privileged: {privileged}}}\n    volumeMounts:\n    - {{name: a, mountPath: /a}}\n    \
                 - {{name: b, mountPath: /b, mountPropagation: {mode}}}\n  volumes:\n  - {{name: a, emptyDir: {{}}}}\n  \
                 - {{name: b, hostPath: {{path: /mnt}}}}\n"
            )
        };
        let error = parse_manifest(p, &pod(false, "Bidirectional"), "n").expect_err("unprivileged").to_string();
        assert!(
            error.contains(
                "spec.containers[0].volumeMounts.mountPropagation: Forbidden: Bidirectional mount propagation is \
                 available only to privileged containers"
            ),
            "{error}"
        );
        let error = parse_manifest(p, &pod(true, "Sideways"), "n").expect_err("unknown mode").to_string();
        assert!(
            error.contains(
                "spec.containers[0].volumeMounts.mountPropagation: Unsupported value: \"Sideways\": supported \
                 values: \"Bidirectional\", \"HostToContainer\", \"None\""
            ),
            "{error}"
        );
        for (privileged, mode) in [(true, "Bidirectional"), (false, "HostToContainer"), (false, "None")] {
            assert_eq!(parse_manifest(p, &pod(privileged, mode), "n").expect(mode).len(), 1, "{mode}");
        }
    }

    /// Fuzz target: static manifest files (YAML and JSON, several
    /// documents) through parsing, defaulting and the name checks that
    /// come before any name becomes a path: objects or an error, never a
    /// panic; every pod accepted has names that are safe as paths.
    #[test]
    fn fuzz_static_manifests() {
        let path = std::path::Path::new("/etc/kubernetes/manifests/fuzz.yaml");
        let ran = crate::fuzz::Fuzz::new("static-manifests").run(|input| {
            let text = String::from_utf8_lossy(input);
            if let Ok(objects) = parse_manifest(path, &text, "fuzz-node") {
                for pod in pods(&objects) {
                    let name = pod.metadata.name.clone().unwrap_or_default();
                    let uid = pod.metadata.uid.clone().unwrap_or_default();
                    for part in [&name, &uid] {
                        assert!(!part.contains('/') && part != ".." && part != ".", "{part:?} became a name");
                    }
                }
            }
        });
        assert!(ran > 3);
    }
}
