//! `rustlet images import`: loads an OCI image layout (a directory, or a
//! tar of one, gzip or not) into the store, for nodes with no registry in
//! reach, as `ctr images import` does on containerd nodes.
//!
//! Each manifest in the layout's `index.json` becomes an image named by
//! its `io.containerd.image.name` annotation, else its
//! `org.opencontainers.image.ref.name` (a bare tag is appended to the
//! `base_name` given, as `ctr --base-name` does). Every blob read is checked
//! against its digest. Imported images are never garbage-collected.

use std::io::Read;
use std::path::Path;

use jiff::Timestamp;
use oci_client::manifest::{OciImageIndex, OciImageManifest};

use crate::pull::{extract_module, is_wasm_platform, parse_reference, plain_image_layer, wasm_layer};
use crate::store::{ImageRecord, ImageStore, ModuleKind, digest_of};

const IMAGE_NAME: &str = "io.containerd.image.name";
const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Imports the layout at `source` (directory or tar); `base_name` names
/// images whose layout gives only a tag. Returns the imported records.
pub fn import(store: &ImageStore, source: &Path, base_name: Option<&str>) -> Result<Vec<ImageRecord>, ImportError> {
    let read = |path: &Path| {
        let path = path.to_owned();
        move |source| ImportError::Read { path, source }
    };
    let meta = std::fs::metadata(source).map_err(read(source))?;
    if meta.is_dir() {
        return import_dir(store, source, base_name).map_err(ImportError::Layout);
    }
    let temporary = store.dir().join("tmp");
    let unpacked = tempfile::Builder::new().prefix("import-").tempdir_in(&temporary).map_err(read(&temporary))?;
    let mut file = std::fs::File::open(source).map_err(read(source))?;
    let mut magic = [0u8; 2];
    let gzip = file.read_exact(&mut magic).is_ok() && magic == [0x1f, 0x8b];
    let file = std::fs::File::open(source).map_err(read(source))?;
    let reader: Box<dyn Read> = if gzip { Box::new(flate2::read::GzDecoder::new(file)) } else { Box::new(file) };
    tar::Archive::new(reader).unpack(unpacked.path()).map_err(|e| {
        ImportError::Layout(format!("{}: not an OCI image layout directory or tar: {e}", source.display()))
    })?;
    import_dir(store, unpacked.path(), base_name).map_err(ImportError::Layout)
}

/// Why an import failed.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The source, or the store's temporary directory, could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file or directory.
        path: std::path::PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// The source is not an importable OCI image layout, or an image in it
    /// could not be stored: what is wrong, naming the image or blob.
    #[error("{0}")]
    Layout(String),
}

fn read_blob(dir: &Path, digest: &str) -> Result<Vec<u8>, String> {
    let hex = digest.strip_prefix("sha256:").ok_or_else(|| format!("unsupported digest {digest}"))?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("invalid digest {digest}"));
    }
    let path = dir.join("blobs/sha256").join(hex);
    let bytes = std::fs::read(&path).map_err(|e| format!("blob {digest}: {e}"))?;
    let actual = digest_of(&bytes);
    if actual != digest {
        return Err(format!("blob {digest} is corrupt: its content has digest {actual}"));
    }
    Ok(bytes)
}

fn import_dir(store: &ImageStore, dir: &Path, base_name: Option<&str>) -> Result<Vec<ImageRecord>, String> {
    let layout = std::fs::read_to_string(dir.join("oci-layout"))
        .map_err(|e| format!("{}: not an OCI image layout (oci-layout: {e})", dir.display()))?;
    if !layout.contains("\"imageLayoutVersion\"") {
        return Err(format!("{}: oci-layout has no imageLayoutVersion", dir.display()));
    }
    let index = std::fs::read(dir.join("index.json")).map_err(|e| format!("index.json: {e}"))?;
    let index: OciImageIndex = serde_json::from_slice(&index).map_err(|e| format!("index.json: {e}"))?;
    let mut imported = Vec::new();
    for entry in &index.manifests {
        let annotations = entry.annotations.clone().unwrap_or_default();
        let name = match (annotations.get(IMAGE_NAME), annotations.get(REF_NAME), base_name) {
            (Some(full), _, _) => full.clone(),
            (None, Some(reference), _) if reference.contains(['/', ':', '@']) => reference.clone(),
            (None, Some(tag), Some(base)) => format!("{base}:{tag}"),
            (None, Some(tag), None) => {
                return Err(format!(
                    "manifest {} is named only by the tag {tag:?}: give a base name (--base-name registry/repository)",
                    entry.digest
                ));
            }
            (None, None, Some(base)) => base.to_owned(),
            (None, None, None) => {
                return Err(format!("manifest {} has no name annotation: give --base-name", entry.digest));
            }
        };
        let name = parse_reference(&name).map_err(|e| e.message)?.whole();
        let mut digest = entry.digest.clone();
        let mut manifest_bytes = read_blob(dir, &digest)?;
        // An index inside: take its wasm entry.
        if let Ok(nested) = serde_json::from_slice::<OciImageIndex>(&manifest_bytes)
            && !nested.manifests.is_empty()
            && nested.media_type.as_deref().is_none_or(|t| t.contains("index") || t.contains("list"))
        {
            let wasm = nested.manifests.iter().find(|m| m.platform.as_ref().is_some_and(is_wasm_platform));
            let wasm = wasm.ok_or_else(|| format!("image {name}: its index has no wasm platform"))?;
            digest = wasm.digest.clone();
            manifest_bytes = read_blob(dir, &digest)?;
        }
        let manifest: OciImageManifest =
            serde_json::from_slice(&manifest_bytes).map_err(|e| format!("image {name}: manifest {digest}: {e}"))?;
        let (layer, format) = wasm_layer(&name, &manifest).map_err(|e| e.message)?;
        let (bytes, default_args) = match layer {
            Some(layer) => (read_blob(dir, &layer.digest)?, Vec::new()),
            None => {
                let config = read_blob(dir, &manifest.config.digest)?;
                let (layer, args) = plain_image_layer(&name, &config, &manifest).map_err(|e| e.message)?;
                read_blob(dir, &layer.digest)?;
                let path = dir.join("blobs/sha256").join(layer.digest.trim_start_matches("sha256:"));
                let module =
                    extract_module(&path, layer.media_type.ends_with("gzip"), args.first().map(String::as_str))
                        .map_err(|e| format!("image {name}: {e}"))?;
                (module, args)
            }
        };
        let kind = ModuleKind::detect(&bytes)
            .ok_or_else(|| format!("image {name}: its layer is not a WebAssembly binary (no \\0asm header)"))?;
        let module = store.write_blob(&bytes).map_err(|e| e.to_string())?;
        let now = Timestamp::now();
        let record = ImageRecord {
            name,
            id: digest,
            module,
            kind,
            size: bytes.len() as u64,
            format: format.to_owned(),
            default_args,
            imported: true,
            created: now,
            last_used: now,
        };
        store.put(record.clone()).map_err(|e| e.to_string())?;
        imported.push(record);
    }
    if imported.is_empty() {
        return Err(format!("{}: index.json lists no manifest", dir.display()));
    }
    Ok(imported)
}

/// Writes an OCI image layout holding one wasm artifact (CNCF layout) per
/// `(name, module bytes)`: what `rustlet images import` loads. The demo and
/// the tests use it to ship modules without a registry.
pub fn write_layout(dir: &Path, images: &[(&str, &[u8])]) -> Result<(), LayoutError> {
    let blobs = dir.join("blobs/sha256");
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| LayoutError::Io { path, source }
    };
    std::fs::create_dir_all(&blobs).map_err(io(&blobs))?;
    let put = |bytes: &[u8]| -> Result<(String, i64), LayoutError> {
        let digest = digest_of(bytes);
        let path = blobs.join(digest.trim_start_matches("sha256:"));
        std::fs::write(&path, bytes).map_err(io(&path))?;
        Ok((digest, bytes.len() as i64))
    };
    let mut manifests = Vec::new();
    for (name, module) in images {
        let kind = ModuleKind::detect(module).ok_or_else(|| LayoutError::NotWasm((*name).to_owned()))?;
        let (layer_digest, layer_size) = put(module)?;
        let os = if kind == ModuleKind::Component { "wasip2" } else { "wasip1" };
        let config = serde_json::json!({
            "created": "2026-01-01T00:00:00Z",
            "architecture": "wasm",
            "os": os,
            "layerDigests": [layer_digest],
        });
        let (config_digest, config_size) = put(&config.to_string().into_bytes())?;
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": oci_client::manifest::OCI_IMAGE_MEDIA_TYPE,
            "config": {"mediaType": crate::pull::WASM_CONFIG_V0, "digest": config_digest, "size": config_size},
            "layers": [{"mediaType": crate::pull::WASM_LAYER, "digest": layer_digest, "size": layer_size}],
        });
        let (digest, size) = put(&manifest.to_string().into_bytes())?;
        manifests.push(serde_json::json!({
            "mediaType": oci_client::manifest::OCI_IMAGE_MEDIA_TYPE,
            "digest": digest,
            "size": size,
            "annotations": {IMAGE_NAME: name},
        }));
    }
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": oci_client::manifest::OCI_IMAGE_INDEX_MEDIA_TYPE,
        "manifests": manifests,
    });
    let layout = dir.join("oci-layout");
    std::fs::write(&layout, br#"{"imageLayoutVersion":"1.0.0"}"#).map_err(io(&layout))?;
    let index_file = dir.join("index.json");
    std::fs::write(&index_file, format!("{index:#}")).map_err(io(&index_file))
}

/// Why an image layout could not be written.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// A file or directory could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: std::path::PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// A module is not a wasm binary.
    #[error("{0}: not a wasm binary")]
    NotWasm(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULE: &[u8] = b"\0asm\x01\0\0\0";

    #[test]
    fn a_layout_round_trips_and_a_corrupt_blob_is_refused() -> Result<(), Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let store = ImageStore::open(root.path())?;
        let layout = root.path().join("layout");
        write_layout(&layout, &[("example.com/demo/hello:v1", MODULE)])?;
        let imported = import(&store, &layout, None)?;
        assert_eq!(imported.len(), 1);
        assert_eq!(imported[0].name, "example.com/demo/hello:v1");
        assert!(imported[0].imported);
        assert_eq!(store.get("example.com/demo/hello:v1")?.map(|r| r.module), Some(digest_of(MODULE)));

        // Tamper with the module blob: the import names the corrupt blob.
        let blob = layout.join("blobs/sha256").join(digest_of(MODULE).trim_start_matches("sha256:"));
        std::fs::write(&blob, b"\0asm\x01\0\0\0tampered")?;
        let error = import(&store, &layout, None).expect_err("corrupt");
        assert!(matches!(&error, ImportError::Layout(m) if m.contains("is corrupt")), "{error}");
        Ok(())
    }

    #[test]
    fn a_tar_of_a_layout_imports_and_a_bare_tag_needs_a_base_name() -> Result<(), Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let store = ImageStore::open(root.path())?;
        let layout = root.path().join("layout");
        write_layout(&layout, &[("example.com/demo/hello:v1", MODULE)])?;
        // Rename the image to a bare tag, as `oras`/`skopeo` layouts do.
        let index = std::fs::read_to_string(layout.join("index.json"))?
            .replace(IMAGE_NAME, REF_NAME)
            .replace("example.com/demo/hello:v1", "v2");
        std::fs::write(layout.join("index.json"), index)?;
        let tar_path = root.path().join("layout.tar");
        let mut builder = tar::Builder::new(std::fs::File::create(&tar_path)?);
        builder.append_dir_all(".", &layout)?;
        builder.finish()?;
        drop(builder);
        let error = import(&store, &tar_path, None).expect_err("bare tag");
        assert!(matches!(&error, ImportError::Layout(m) if m.contains("--base-name")), "{error}");
        let imported = import(&store, &tar_path, Some("example.com/demo/hello"))?;
        assert_eq!(imported[0].name, "example.com/demo/hello:v2");
        Ok(())
    }

    #[test]
    fn not_a_layout_says_so() -> Result<(), Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let store = ImageStore::open(root.path())?;
        let error = import(&store, root.path(), None).expect_err("no layout");
        assert!(matches!(&error, ImportError::Layout(m) if m.contains("not an OCI image layout")), "{error}");
        Ok(())
    }
}
