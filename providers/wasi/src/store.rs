//! The image store under `<root-dir>/images/`: WebAssembly modules by
//! digest, and a record per image name saying which module it runs.
//!
//! ```text
//! images/
//!   lock                     held (flock) while the index is changed
//!   index.json               one record per image name
//!   blobs/sha256/<hex>       module bytes, verified, written once (temp + rename)
//!   tmp/                     downloads in progress
//! ```
//!
//! The node and `rustlet images` (a second process) share the store: every
//! change to the index takes the lock and rewrites the file atomically.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use jiff::Timestamp;
use sha2::{Digest, Sha256};

/// Whether a binary is a core module (WASI preview 1) or a component
/// (WASI preview 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModuleKind {
    /// A core module (`_start`, WASI preview 1).
    Module,
    /// A component (`wasi:cli/run`, WASI preview 2).
    Component,
}

impl ModuleKind {
    /// What `bytes` are, from the wasm header; `None` when they are not wasm.
    pub(crate) fn detect(bytes: &[u8]) -> Option<ModuleKind> {
        if bytes.get(0..4) != Some(b"\0asm") {
            return None;
        }
        match bytes.get(4..8) {
            Some([1, 0, 0, 0]) => Some(ModuleKind::Module),
            Some([0x0d, 0, 1, 0]) => Some(ModuleKind::Component),
            _ => None,
        }
    }
}

/// One image the store knows by name.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageRecord {
    /// The full reference (`registry/repository:tag` or `...@sha256:...`).
    pub name: String,
    /// The image's id: the digest of its manifest.
    pub id: String,
    /// The digest of the module's bytes (its blob in the store).
    pub module: String,
    /// Module or component.
    pub kind: ModuleKind,
    /// The module's size in bytes.
    pub size: u64,
    /// How the image packs its module (`wasm-artifact`, `wasm-to-oci`,
    /// `image-layer`).
    pub format: String,
    /// The image config's `Entrypoint` + `Cmd` (plain images only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub default_args: Vec<String>,
    /// Loaded with `rustlet images import`: kept until `rustlet images rm`,
    /// never garbage-collected, never pulled again under `IfNotPresent`.
    pub imported: bool,
    /// When it entered the store.
    pub created: Timestamp,
    /// When a container last used it.
    pub last_used: Timestamp,
}

#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Index {
    images: Vec<ImageRecord>,
}

/// An error of the store (I/O, a corrupt index).
#[derive(Debug, thiserror::Error)]
#[error("image store {path}: {message}")]
pub struct StoreError {
    path: PathBuf,
    message: String,
}

fn store_error(path: &Path, error: impl std::fmt::Display) -> StoreError {
    StoreError { path: path.to_path_buf(), message: error.to_string() }
}

/// The image store.
#[derive(Clone, Debug)]
pub struct ImageStore {
    dir: PathBuf,
}

/// The index lock, held while it lives.
struct Locked(#[allow(dead_code)] File);

/// `sha256:<hex>` of `bytes`.
pub fn digest_of(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let mut text = String::with_capacity(71);
    text.push_str("sha256:");
    for byte in hash {
        text.push_str(&format!("{byte:02x}"));
    }
    text
}

impl ImageStore {
    /// The store under `root_dir/images`, created if missing.
    pub fn open(root_dir: &Path) -> Result<ImageStore, StoreError> {
        let dir = root_dir.join("images");
        for sub in ["blobs/sha256", "tmp"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(|e| store_error(&dir, e))?;
        }
        Ok(ImageStore { dir })
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn lock(&self) -> Result<Locked, StoreError> {
        let path = self.dir.join("lock");
        let file =
            File::options().create(true).truncate(false).write(true).open(&path).map_err(|e| store_error(&path, e))?;
        file.lock().map_err(|e| store_error(&path, e))?;
        Ok(Locked(file))
    }

    fn read_index(&self) -> Result<Index, StoreError> {
        let path = self.dir.join("index.json");
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| store_error(&path, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Index::default()),
            Err(e) => Err(store_error(&path, e)),
        }
    }

    fn write_index(&self, index: &Index) -> Result<(), StoreError> {
        let path = self.dir.join("index.json");
        let bytes = serde_json::to_vec_pretty(index).map_err(|e| store_error(&path, e))?;
        write_atomically(&path, &bytes).map_err(|e| store_error(&path, e))
    }

    /// Changes the index under the lock.
    fn update<R>(&self, change: impl FnOnce(&mut Vec<ImageRecord>) -> R) -> Result<R, StoreError> {
        let _lock = self.lock()?;
        let mut index = self.read_index()?;
        let result = change(&mut index.images);
        self.write_index(&index)?;
        Ok(result)
    }

    /// Every image, by name.
    pub fn list(&self) -> Result<Vec<ImageRecord>, StoreError> {
        let mut images = self.read_index()?.images;
        images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(images)
    }

    /// The image named `name` whose module is present.
    pub(crate) fn get(&self, name: &str) -> Result<Option<ImageRecord>, StoreError> {
        Ok(self.read_index()?.images.into_iter().find(|r| r.name == name && self.has_blob(&r.module)))
    }

    /// Any image whose id is `id` (the same manifest under another name),
    /// whose module is present.
    pub(crate) fn by_id(&self, id: &str) -> Result<Option<ImageRecord>, StoreError> {
        Ok(self.read_index()?.images.into_iter().find(|r| r.id == id && self.has_blob(&r.module)))
    }

    /// Adds `record`, replacing one of the same name. An imported image
    /// stays imported when the same image is pulled under its name.
    pub(crate) fn put(&self, mut record: ImageRecord) -> Result<(), StoreError> {
        self.update(|images| {
            if let Some(old) = images.iter().position(|r| r.name == record.name) {
                let old = images.remove(old);
                record.imported |= old.imported && old.id == record.id;
            }
            images.push(record);
        })
    }

    /// Marks `name` as used now (at most once a minute, to keep starts
    /// cheap).
    pub(crate) fn touch(&self, record: &ImageRecord) -> Result<(), StoreError> {
        let now = Timestamp::now();
        if now.duration_since(record.last_used).as_secs() < 60 {
            return Ok(());
        }
        self.update(|images| {
            for image in images.iter_mut().filter(|r| r.name == record.name) {
                image.last_used = now;
            }
        })
    }

    /// Removes the images named `name`, or whose id starts with `name`
    /// (`sha256:abc...` or the bare hex); then the modules no image uses.
    /// Returns what was removed.
    pub fn remove(&self, name: &str) -> Result<Vec<ImageRecord>, StoreError> {
        let matches = |r: &ImageRecord| {
            r.name == name
                || (name.len() >= 12
                    && (r.id.starts_with(name) || r.id.trim_start_matches("sha256:").starts_with(name)))
        };
        let removed = self.update(|images| {
            let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(images).into_iter().partition(matches);
            *images = kept;
            gone
        })?;
        self.remove_unused_blobs()?;
        Ok(removed)
    }

    /// Removes pulled (not imported) images that no container in `in_use`
    /// (image names) uses and that were last used before `unused_since`;
    /// then the modules no image uses. Returns what was removed.
    pub(crate) fn collect_garbage(
        &self,
        in_use: &HashSet<String>,
        unused_since: Timestamp,
    ) -> Result<Vec<ImageRecord>, StoreError> {
        let removed = self.update(|images| {
            let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(images)
                .into_iter()
                .partition(|r| !r.imported && !in_use.contains(&r.name) && r.last_used < unused_since);
            *images = kept;
            gone
        })?;
        self.remove_unused_blobs()?;
        Ok(removed)
    }

    fn remove_unused_blobs(&self) -> Result<(), StoreError> {
        let _lock = self.lock()?;
        let used: HashSet<String> = self.read_index()?.images.into_iter().map(|r| r.module).collect();
        let blobs = self.dir.join("blobs/sha256");
        for entry in std::fs::read_dir(&blobs).map_err(|e| store_error(&blobs, e))?.flatten() {
            let digest = format!("sha256:{}", entry.file_name().to_string_lossy());
            if !used.contains(&digest) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(())
    }

    /// Where the blob `digest` lives.
    pub(crate) fn blob_path(&self, digest: &str) -> PathBuf {
        self.dir.join("blobs/sha256").join(digest.trim_start_matches("sha256:"))
    }

    /// Whether the blob `digest` is present.
    pub fn has_blob(&self, digest: &str) -> bool {
        self.blob_path(digest).is_file()
    }

    /// A fresh path for a download in progress.
    pub(crate) fn temp_path(&self, hint: &str) -> PathBuf {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.dir.join("tmp").join(format!("{}-{}-{n}", hint.trim_start_matches("sha256:"), std::process::id()))
    }

    /// Stores `bytes` as a blob and returns its digest.
    pub(crate) fn write_blob(&self, bytes: &[u8]) -> Result<String, StoreError> {
        let digest = digest_of(bytes);
        let path = self.blob_path(&digest);
        if !path.is_file() {
            let temp = self.temp_path(&digest);
            std::fs::write(&temp, bytes).map_err(|e| store_error(&temp, e))?;
            std::fs::rename(&temp, &path).map_err(|e| store_error(&path, e))?;
        }
        Ok(digest)
    }

    /// Reads the blob `digest`, checking its digest.
    pub(crate) fn read_blob(&self, digest: &str) -> Result<Vec<u8>, StoreError> {
        let path = self.blob_path(digest);
        let bytes = std::fs::read(&path).map_err(|e| store_error(&path, e))?;
        let actual = digest_of(&bytes);
        if actual != digest {
            let _ = std::fs::remove_file(&path);
            return Err(store_error(&path, format!("corrupt blob: digest {actual}, want {digest}; removed")));
        }
        Ok(bytes)
    }
}

/// Writes `bytes` to `path` durably ([`kubelet_support::durable`]): a reader sees
/// the old or the new content, never a part, after a crash too.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    kubelet_support::durable::write(path, bytes, 0o644)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, module: &str, imported: bool, last_used: Timestamp) -> ImageRecord {
        ImageRecord {
            name: name.into(),
            id: format!("sha256:{}", "1".repeat(64)),
            module: module.into(),
            kind: ModuleKind::Module,
            size: 8,
            format: "wasm-artifact".into(),
            default_args: Vec::new(),
            imported,
            created: last_used,
            last_used,
        }
    }

    #[test]
    fn module_kinds_come_from_the_header() {
        assert_eq!(ModuleKind::detect(b"\0asm\x01\0\0\0"), Some(ModuleKind::Module));
        assert_eq!(ModuleKind::detect(b"\0asm\x0d\0\x01\0"), Some(ModuleKind::Component));
        assert_eq!(ModuleKind::detect(b"\x7fELF\x02\x01\x01\0"), None);
        assert_eq!(ModuleKind::detect(b"\0as"), None);
    }

    #[test]
    fn garbage_collection_keeps_imported_and_used_images() -> Result<(), Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let store = ImageStore::open(root.path())?;
        let old = Timestamp::now() - jiff::SignedDuration::from_secs(3600);
        let a = store.write_blob(b"\0asm\x01\0\0\0a")?;
        let b = store.write_blob(b"\0asm\x01\0\0\0b")?;
        let c = store.write_blob(b"\0asm\x01\0\0\0c")?;
        store.put(record("r/unused:1", &a, false, old))?;
        store.put(record("r/imported:1", &b, true, old))?;
        store.put(record("r/used:1", &c, false, old))?;
        let in_use = HashSet::from(["r/used:1".to_owned()]);
        let removed = store.collect_garbage(&in_use, Timestamp::now())?;
        assert_eq!(removed.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["r/unused:1"]);
        assert!(!store.has_blob(&a) && store.has_blob(&b) && store.has_blob(&c));
        assert_eq!(store.list()?.len(), 2);
        let removed = store.remove("r/imported:1")?;
        assert_eq!(removed.len(), 1);
        assert!(!store.has_blob(&b));
        Ok(())
    }

    #[test]
    fn a_corrupt_blob_is_detected_and_dropped() -> Result<(), Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let store = ImageStore::open(root.path())?;
        let digest = store.write_blob(b"\0asm\x01\0\0\0")?;
        std::fs::write(store.blob_path(&digest), b"tampered")?;
        let error = store.read_blob(&digest).expect_err("corrupt").to_string();
        assert!(error.contains("corrupt blob"), "{error}");
        assert!(!store.has_blob(&digest));
        Ok(())
    }
}
