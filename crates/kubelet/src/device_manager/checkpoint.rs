//! The device manager's checkpoint: allocations survive a restart.
//!
//! File `kubelet_internal_checkpoint` in the device-plugins directory, in the
//! upstream JSON shape:
//! `{"Data":{"PodDeviceEntries":[{"PodUID","ContainerName","ResourceName",
//! "DeviceIDs":{"<numa>":[ids]},"AllocResp":"<base64 proto>"}],
//! "RegisteredDevices":{"<resource>":[ids]}},"Checksum":N}`, plus one field of
//! ours per entry (`RustletContainerKind`) that upstream readers ignore.
//!
//! The checksum is FNV-1a (64 bit) of the `Data` object's JSON. Upstream
//! hashes Go's `%#v` rendering of its structs, which no other program can
//! reproduce, so a checkpoint is not interchangeable with a Go kubelet's (it
//! is read by this node only).
//!
//! Writes are atomic (temporary file, fsync, rename, fsync of the directory).
//! A file that is empty, truncated, fails its checksum or has an unknown shape
//! is reported and moved aside (never deleted), and the node starts clean.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use kubelet_api::deviceplugin::v1beta1 as api;
use prost::Message as _;

use super::allocate::{ContainerKind, ContainerRecord, Held};
use super::run_options::RunOptions;

/// The checkpoint's file name, as upstream.
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

/// Why a checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing the file failed.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a checkpoint of the expected shape.
    #[error("checkpoint {path} is unreadable: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(rename = "Data")]
    data: Data,
    #[serde(rename = "Checksum")]
    checksum: u64,
}

#[derive(Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Data {
    #[serde(rename = "PodDeviceEntries")]
    entries: Vec<Entry>,
    #[serde(rename = "RegisteredDevices")]
    registered: BTreeMap<String, Vec<String>>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    #[serde(rename = "PodUID")]
    pod_uid: String,
    #[serde(rename = "ContainerName")]
    container_name: String,
    #[serde(rename = "ResourceName")]
    resource_name: String,
    #[serde(rename = "DeviceIDs")]
    device_ids: BTreeMap<String, Vec<String>>,
    #[serde(rename = "AllocResp")]
    alloc_resp: String,
    #[serde(rename = "RustletContainerKind", default = "app_kind")]
    kind: ContainerKind,
}

fn app_kind() -> ContainerKind {
    ContainerKind::App
}

/// What a checkpoint holds, in our types.
#[derive(Default)]
pub(crate) struct Restored {
    pub(crate) pods: BTreeMap<String, BTreeMap<String, ContainerRecord>>,
    pub(crate) registered: BTreeMap<String, Vec<String>>,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// Renders the allocations and the registered devices as a checkpoint.
pub(crate) fn encode(
    pods: &BTreeMap<String, BTreeMap<String, ContainerRecord>>,
    registered: BTreeMap<String, Vec<String>>,
    numa: &dyn Fn(&str, &str) -> i64,
) -> Result<Vec<u8>, serde_json::Error> {
    let mut entries = Vec::new();
    for (pod_uid, containers) in pods {
        for (container_name, record) in containers {
            for (resource_name, held) in &record.resources {
                let mut device_ids: BTreeMap<String, Vec<String>> = BTreeMap::new();
                for id in &held.device_ids {
                    device_ids.entry(numa(resource_name, id).to_string()).or_default().push(id.clone());
                }
                let response = api::ContainerAllocateResponse::from(&held.options);
                entries.push(Entry {
                    pod_uid: pod_uid.clone(),
                    container_name: container_name.clone(),
                    resource_name: resource_name.clone(),
                    device_ids,
                    alloc_resp: base64::engine::general_purpose::STANDARD.encode(response.encode_to_vec()),
                    kind: record.kind,
                });
            }
        }
    }
    let data = Data { entries, registered };
    let checksum = fnv1a(&serde_json::to_vec(&data)?);
    serde_json::to_vec(&File { data, checksum })
}

/// Parses a checkpoint.
pub(crate) fn decode(path: &Path, bytes: &[u8]) -> Result<Restored, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt { path: path.to_path_buf(), reason };
    if bytes.is_empty() {
        return Err(corrupt("the file is empty".into()));
    }
    let file: File = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
    let data_json = serde_json::to_vec(&file.data).map_err(|e| corrupt(e.to_string()))?;
    let computed = fnv1a(&data_json);
    if computed != file.checksum {
        return Err(corrupt(format!("checksum mismatch: file says {}, content gives {computed}", file.checksum)));
    }
    let mut restored = Restored { pods: BTreeMap::new(), registered: file.data.registered };
    for entry in file.data.entries {
        let proto = base64::engine::general_purpose::STANDARD
            .decode(&entry.alloc_resp)
            .map_err(|e| corrupt(format!("AllocResp of {}/{}: {e}", entry.pod_uid, entry.container_name)))?;
        let response = api::ContainerAllocateResponse::decode(proto.as_slice())
            .map_err(|e| corrupt(format!("AllocResp of {}/{}: {e}", entry.pod_uid, entry.container_name)))?;
        let mut device_ids: Vec<String> = entry.device_ids.into_values().flatten().collect();
        device_ids.sort();
        restored
            .pods
            .entry(entry.pod_uid)
            .or_default()
            .entry(entry.container_name)
            .or_insert_with(|| ContainerRecord { kind: entry.kind, resources: BTreeMap::new() })
            .resources
            .insert(entry.resource_name, Held { device_ids, options: RunOptions::from(response) });
    }
    Ok(restored)
}

/// Writes `bytes` to `path` atomically and durably.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let tmp = dir.join(format!(".{CHECKPOINT_FILE}.tmp"));
    let mut file = std::fs::File::create(&tmp).map_err(io)?;
    file.write_all(bytes).map_err(io)?;
    file.sync_all().map_err(io)?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io)?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    Ok(())
}

/// Reads the checkpoint at `path`. A missing file is an empty checkpoint; an
/// unreadable one is moved aside to `<name>.corrupt-<unix seconds>` and
/// reported, and the node starts clean.
pub(crate) fn load(path: &Path) -> Restored {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Restored::default(),
        Err(source) => {
            tracing::error!(error = %CheckpointError::Io { path: path.to_path_buf(), source }, "cannot read the device checkpoint; starting without it");
            return Restored::default();
        }
    };
    match decode(path, &bytes) {
        Ok(restored) => restored,
        Err(error) => {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            let aside = path.with_file_name(format!("{CHECKPOINT_FILE}.corrupt-{stamp}"));
            match std::fs::rename(path, &aside) {
                Ok(()) => {
                    tracing::error!(%error, moved_to = %aside.display(), "device checkpoint is corrupt; moved aside, starting clean")
                }
                Err(e) => {
                    tracing::error!(%error, rename_error = %e, "device checkpoint is corrupt and could not be moved aside; starting clean")
                }
            }
            Restored::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> BTreeMap<String, BTreeMap<String, ContainerRecord>> {
        let mut options = RunOptions::default();
        options.envs.insert("FAKE_DEVICES".into(), "a,b".into());
        options.cdi_devices.push("v.com/gpu=a".into());
        let held = Held { device_ids: vec!["a".into(), "b".into()], options };
        let record = ContainerRecord { kind: ContainerKind::Init, resources: [("v.com/gpu".to_owned(), held)].into() };
        [("uid-1".to_owned(), [("c".to_owned(), record)].into())].into()
    }

    #[test]
    fn round_trip_in_the_upstream_shape() {
        let bytes = encode(&sample(), [("v.com/gpu".to_owned(), vec!["a".into(), "b".into()])].into(), &|_, id| {
            if id == "a" { 0 } else { -1 }
        })
        .expect("encode");
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        let entry = &json["Data"]["PodDeviceEntries"][0];
        assert_eq!(entry["PodUID"], "uid-1");
        assert_eq!(entry["DeviceIDs"]["0"][0], "a");
        assert_eq!(entry["DeviceIDs"]["-1"][0], "b");
        assert!(entry["AllocResp"].is_string());
        assert_eq!(json["Data"]["RegisteredDevices"]["v.com/gpu"][1], "b");
        let restored = decode(Path::new("cp"), &bytes).expect("decode");
        let held = &restored.pods["uid-1"]["c"].resources["v.com/gpu"];
        assert_eq!(held.device_ids, ["a", "b"]);
        assert_eq!(held.options.envs["FAKE_DEVICES"], "a,b");
        assert_eq!(restored.pods["uid-1"]["c"].kind, ContainerKind::Init);
    }

    #[test]
    fn bad_checkpoints_are_refused_with_a_reason() {
        let good = encode(&sample(), BTreeMap::new(), &|_, _| -1).expect("encode");
        // Same shape, one value changed, the old checksum kept.
        let mut value: serde_json::Value = serde_json::from_slice(&good).expect("json");
        value["Data"]["PodDeviceEntries"][0]["PodUID"] = "uid-2".into();
        let flipped = serde_json::to_vec(&value).expect("json");
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("empty", vec![], "the file is empty"),
            ("truncated", good[..good.len() / 2].to_vec(), "EOF while parsing"),
            ("wrong checksum", flipped, "checksum mismatch"),
            ("unknown version", br#"{"Data":{"Version":2},"Checksum":1}"#.to_vec(), "unknown field `Version`"),
        ];
        for (what, bytes, reason) in cases {
            let err = decode(Path::new("/dp/kubelet_internal_checkpoint"), &bytes)
                .err()
                .unwrap_or_else(|| panic!("{what} accepted"));
            assert!(err.to_string().contains(reason), "{what}: {err}");
            assert!(
                err.to_string().starts_with("checkpoint /dp/kubelet_internal_checkpoint is unreadable"),
                "{what}: {err}"
            );
        }
    }

    #[test]
    fn a_corrupt_file_is_moved_aside_not_deleted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(CHECKPOINT_FILE);
        std::fs::write(&path, b"{not json").expect("write");
        let restored = load(&path);
        assert!(restored.pods.is_empty());
        assert!(!path.exists());
        let aside: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("kubelet_internal_checkpoint.corrupt-"))
            .collect();
        assert_eq!(aside.len(), 1);
        assert_eq!(std::fs::read(aside[0].path()).expect("read"), b"{not json");
    }
}
