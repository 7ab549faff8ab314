//! The device manager's checkpoint: allocations survive a restart.
//!
//! File `kubelet_internal_checkpoint` in the device-plugins directory, in the
//! upstream JSON shape:
//! `{"Data":{"PodDeviceEntries":[{"PodUID","ContainerName","ResourceName",
//! "DeviceIDs":{"<numa>":[ids]},"AllocResp":"<base64 proto>"}],
//! "RegisteredDevices":{"<resource>":[ids]}},"Checksum":N}`, plus one field of
//! ours per entry (`RustletContainerKind`) that upstream readers ignore.
//!
//! The checksum is our own, and it is not a hash of the file. The file is
//! made of parts: each `PodDeviceEntries` element's JSON, then each
//! `RegisteredDevices` member as `"<resource>":[ids]`. Each part is hashed
//! on its own with FNV-1a (64 bit) over its JSON bytes; the checksum then
//! combines those hashes in file order, one 64-bit word per part: starting
//! from FNV's offset basis, `sum = (sum XOR part_hash) * FNV_PRIME` (wrapping).
//! Upstream hashes Go's `%#v` rendering of its structs, which no other
//! program can reproduce, so a checkpoint is not interchangeable with a Go
//! kubelet's (it is read by this node only). Hashing parts lets every part be
//! encoded and hashed once, when its allocation is made, so a write hands the
//! parts to one `writev` loop instead of re-encoding every allocation on the
//! node.
//!
//! Encoding a part can fail only on a bug (it is plain strings and maps), but
//! a failure is an error, never an empty part: an allocation whose entry
//! cannot be encoded is refused, and a write that cannot encode a part fails.
//!
//! Writes are atomic (temporary file, fsync, rename, fsync of the directory).
//! A file that is empty, truncated, fails its checksum or has an unknown shape
//! is reported and moved aside (never deleted), and the node starts clean.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use kubelet_api::deviceplugin::v1beta1 as api;
use prost::Message as _;

use super::allocate::ContainerKind;
use super::allocations::{ContainerRecord, Held};
use super::run_options::RunOptions;
use super::writer::CheckpointWriteError;

/// The checkpoint's file name, as upstream.
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

/// Why a checkpoint could not be read (writing fails with a
/// [`CheckpointWriteError`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CheckpointError {
    /// Reading the file failed.
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
    /// Each registered resource's `RegisteredDevices` member, as read.
    pub(crate) registered: BTreeMap<String, Arc<Part>>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET, |hash, b| (hash ^ u64::from(*b)).wrapping_mul(FNV_PRIME))
}

/// One piece of the checkpoint, encoded and hashed once: a
/// `PodDeviceEntries` element or a `RegisteredDevices` member.
#[derive(Debug)]
pub(crate) struct Part {
    /// `,` and the JSON: the separator is kept so that a write needs one
    /// slice per part (the first part's is skipped).
    json: Vec<u8>,
    /// FNV-1a of the JSON, without the separator.
    hash: u64,
}

impl Part {
    fn new(json: &[u8]) -> Part {
        let mut separated = Vec::with_capacity(json.len() + 1);
        separated.push(b',');
        separated.extend_from_slice(json);
        Part { json: separated, hash: fnv1a(json) }
    }

    /// The entry of one container's devices of one resource; `devices` are
    /// the device IDs with their NUMA node (-1: none).
    pub(crate) fn entry(
        pod_uid: &str,
        container_name: &str,
        resource_name: &str,
        kind: ContainerKind,
        devices: &[(String, i64)],
        options: &RunOptions,
    ) -> Result<Part, CheckpointWriteError> {
        let mut device_ids: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (id, numa) in devices {
            device_ids.entry(numa.to_string()).or_default().push(id.clone());
        }
        let response = api::ContainerAllocateResponse::from(options);
        Part::of_entry(&Entry {
            pod_uid: pod_uid.to_owned(),
            container_name: container_name.to_owned(),
            resource_name: resource_name.to_owned(),
            device_ids,
            alloc_resp: base64::engine::general_purpose::STANDARD.encode(response.encode_to_vec()),
            kind,
        })
    }

    fn of_entry(entry: &Entry) -> Result<Part, CheckpointWriteError> {
        let what = || format!("the entry of {}/{} {}", entry.pod_uid, entry.container_name, entry.resource_name);
        Ok(Part::new(&encode_json(what, entry)?))
    }

    /// The registered devices of one resource.
    pub(crate) fn registered<'a>(
        resource: &str,
        ids: impl Iterator<Item = &'a str>,
    ) -> Result<Part, CheckpointWriteError> {
        let what = || format!("the registered devices of {resource}");
        let mut json = encode_json(what, resource)?;
        json.push(b':');
        json.extend(encode_json(what, &ids.collect::<Vec<_>>())?);
        Ok(Part::new(&json))
    }
}

/// Encodes `value` as JSON; `what` names it in the error.
fn encode_json<T: serde::Serialize + ?Sized>(
    what: impl FnOnce() -> String,
    value: &T,
) -> Result<Vec<u8>, CheckpointWriteError> {
    serde_json::to_vec(value).map_err(|source| CheckpointWriteError::Encode { what: what(), source: Arc::new(source) })
}

/// The checksum of a checkpoint made of these parts, in file order: FNV-1a
/// taken over the parts' 64-bit hashes as words.
fn checksum<'a>(parts: impl Iterator<Item = &'a Part>) -> u64 {
    parts.fold(FNV_OFFSET, |sum, part| (sum ^ part.hash).wrapping_mul(FNV_PRIME))
}

/// Calls `f` with the checkpoint made of these parts as a list of byte
/// slices (entries in pod, container, resource order; registered devices in
/// resource order), so it can be written without copying the parts.
fn with_pieces<R>(entries: &[Arc<Part>], registered: &[Arc<Part>], f: impl FnOnce(&[&[u8]]) -> R) -> R {
    let sum = format!(r#"}}}},"Checksum":{}}}"#, checksum(entries.iter().chain(registered).map(|p| &**p)));
    let mut pieces: Vec<&[u8]> = Vec::with_capacity(entries.len() + registered.len() + 3);
    pieces.push(br#"{"Data":{"PodDeviceEntries":["#);
    join(&mut pieces, entries);
    pieces.push(br#"],"RegisteredDevices":{"#);
    join(&mut pieces, registered);
    pieces.push(sum.as_bytes());
    f(&pieces)
}

fn join<'a>(pieces: &mut Vec<&'a [u8]>, parts: &'a [Arc<Part>]) {
    for (i, part) in parts.iter().enumerate() {
        pieces.push(if i == 0 { &part.json[1..] } else { &part.json });
    }
}

/// Renders a checkpoint from its parts.
#[cfg(test)]
pub(crate) fn assemble(entries: &[Arc<Part>], registered: &[Arc<Part>]) -> Vec<u8> {
    with_pieces(entries, registered, |pieces| pieces.concat())
}

/// Writes the checkpoint made of these parts to `path` atomically and durably.
pub(crate) fn write_parts(
    path: &Path,
    entries: &[Arc<Part>],
    registered: &[Arc<Part>],
) -> Result<(), CheckpointWriteError> {
    with_pieces(entries, registered, |pieces| {
        write_atomically(path, |file| {
            let mut slices: Vec<std::io::IoSlice<'_>> = pieces.iter().map(|p| std::io::IoSlice::new(p)).collect();
            let mut rest = &mut slices[..];
            while !rest.is_empty() {
                match file.write_vectored(rest) {
                    Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                    Ok(n) => std::io::IoSlice::advance_slices(&mut rest, n),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
    })
}

/// Parses a checkpoint.
pub(crate) fn decode(path: &Path, bytes: &[u8]) -> Result<Restored, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt { path: path.to_path_buf(), reason };
    if bytes.is_empty() {
        return Err(corrupt("the file is empty".into()));
    }
    let file: File = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
    // Re-encoding what was just decoded from JSON cannot fail but on a bug.
    let reencode = |e: CheckpointWriteError| corrupt(e.to_string());
    let entries: Vec<(Entry, Part)> = file
        .data
        .entries
        .into_iter()
        .map(|entry| {
            let part = Part::of_entry(&entry).map_err(reencode)?;
            Ok((entry, part))
        })
        .collect::<Result<_, CheckpointError>>()?;
    let registered: BTreeMap<String, Arc<Part>> = file
        .data
        .registered
        .iter()
        .map(|(name, ids)| {
            let part = Part::registered(name, ids.iter().map(String::as_str)).map_err(reencode)?;
            Ok((name.clone(), Arc::new(part)))
        })
        .collect::<Result<_, CheckpointError>>()?;
    let computed = checksum(entries.iter().map(|(_, p)| p).chain(registered.values().map(|p| &**p)));
    if computed != file.checksum {
        return Err(corrupt(format!("checksum mismatch: file says {}, content gives {computed}", file.checksum)));
    }
    let mut restored = Restored { pods: BTreeMap::new(), registered };
    for (entry, part) in entries {
        let proto = base64::engine::general_purpose::STANDARD
            .decode(&entry.alloc_resp)
            .map_err(|e| corrupt(format!("AllocResp of {}/{}: {e}", entry.pod_uid, entry.container_name)))?;
        let response = api::ContainerAllocateResponse::decode(proto.as_slice())
            .map_err(|e| corrupt(format!("AllocResp of {}/{}: {e}", entry.pod_uid, entry.container_name)))?;
        let mut device_ids: Vec<String> = entry.device_ids.into_values().flatten().collect();
        device_ids.sort();
        let held = Held { device_ids, options: RunOptions::from(response), encoded: Arc::new(part) };
        restored
            .pods
            .entry(entry.pod_uid)
            .or_default()
            .entry(entry.container_name)
            .or_insert_with(|| ContainerRecord { kind: entry.kind, resources: BTreeMap::new() })
            .resources
            .insert(entry.resource_name, held);
    }
    Ok(restored)
}

/// Writes the checkpoint at `path` durably ([`crate::durable`]): `write`
/// fills the temporary file.
fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<(), CheckpointWriteError> {
    crate::durable::write_with(path, 0o644, write)
        .map_err(|source| CheckpointWriteError::Io { path: path.to_path_buf(), source: Arc::new(source) })
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

    fn sample(registered: bool) -> Vec<u8> {
        let mut options = RunOptions::default();
        options.envs.insert("FAKE_DEVICES".into(), "a,b".into());
        options.cdi_devices.push("v.com/gpu=a".into());
        let devices = [("a".to_owned(), 0), ("b".to_owned(), -1)];
        let entry = Part::entry("uid-1", "c", "v.com/gpu", ContainerKind::Init, &devices, &options).expect("encode");
        let registered: Vec<Arc<Part>> = if registered {
            vec![Arc::new(Part::registered("v.com/gpu", ["a", "b"].into_iter()).expect("encode"))]
        } else {
            vec![]
        };
        assemble(&[Arc::new(entry)], &registered)
    }

    #[test]
    fn round_trip_in_the_upstream_shape() {
        let bytes = sample(true);
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        let entry = &json["Data"]["PodDeviceEntries"][0];
        assert_eq!(entry["PodUID"], "uid-1");
        assert_eq!(entry["ContainerName"], "c");
        assert_eq!(entry["ResourceName"], "v.com/gpu");
        assert_eq!(entry["DeviceIDs"]["0"][0], "a");
        assert_eq!(entry["DeviceIDs"]["-1"][0], "b");
        assert!(entry["AllocResp"].is_string());
        assert_eq!(json["Data"]["RegisteredDevices"]["v.com/gpu"][1], "b");
        assert!(json["Checksum"].is_u64());
        let restored = decode(Path::new("cp"), &bytes).expect("decode");
        let held = &restored.pods["uid-1"]["c"].resources["v.com/gpu"];
        assert_eq!(held.device_ids, ["a", "b"]);
        assert_eq!(held.options.envs["FAKE_DEVICES"], "a,b");
        assert_eq!(restored.pods["uid-1"]["c"].kind, ContainerKind::Init);
        // A restored part re-assembles to the same file.
        let registered: Vec<Arc<Part>> = restored.registered.values().cloned().collect();
        assert_eq!(assemble(std::slice::from_ref(&held.encoded), &registered), bytes);
    }

    /// More parts than one `writev` takes (1,024 slices): the loop writes
    /// them all, byte for byte what `assemble` renders.
    #[test]
    fn a_large_checkpoint_is_written_whole() {
        let options = RunOptions::default();
        let entries: Vec<Arc<Part>> = (0..1500)
            .map(|i| {
                let devices = [(format!("d{i:04}"), i64::from(i % 2))];
                let entry =
                    Part::entry(&format!("uid-{i:04}"), "c", "v.com/gpu", ContainerKind::App, &devices, &options);
                Arc::new(entry.expect("encode"))
            })
            .collect();
        let ids: Vec<String> = (0..1500).map(|i| format!("d{i:04}")).collect();
        let registered = [Arc::new(Part::registered("v.com/gpu", ids.iter().map(String::as_str)).expect("encode"))];
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(CHECKPOINT_FILE);
        write_parts(&path, &entries, &registered).expect("write");
        let bytes = std::fs::read(&path).expect("read");
        assert_eq!(bytes, assemble(&entries, &registered));
        let restored = decode(&path, &bytes).expect("decode");
        assert_eq!(restored.pods.len(), 1500);
        assert_eq!(restored.pods["uid-1499"]["c"].resources["v.com/gpu"].device_ids, ["d1499"]);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).expect("list").flatten().map(|e| e.file_name()).collect();
        assert_eq!(leftovers, [CHECKPOINT_FILE], "no temporary file left");
    }

    #[test]
    fn an_empty_checkpoint_is_valid_json_and_round_trips() {
        let bytes = assemble(&[], &[]);
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(json["Data"]["PodDeviceEntries"], serde_json::json!([]));
        let restored = decode(Path::new("cp"), &bytes).expect("decode");
        assert!(restored.pods.is_empty() && restored.registered.is_empty());
    }

    #[test]
    fn bad_checkpoints_are_refused_with_a_reason() {
        let good = sample(false);
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

    /// Bad input: a value JSON cannot encode (a map with non-string keys)
    /// is an encode error naming what was encoded, never an empty part.
    #[test]
    fn a_value_that_cannot_be_encoded_is_an_error() {
        let unencodable: BTreeMap<Vec<u8>, u8> = [(vec![1], 1)].into_iter().collect();
        let err = encode_json(|| "the entry of uid-1/c v.com/gpu".to_owned(), &unencodable).expect_err("encoded");
        assert!(matches!(err, CheckpointWriteError::Encode { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            "cannot encode the entry of uid-1/c v.com/gpu for the device checkpoint: key must be a string"
        );
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

    /// Fuzz target: the device checkpoint's bytes as the node reads them at
    /// start: decoded, or refused with a reason; never a panic.
    #[test]
    fn fuzz_device_checkpoint() {
        let path = Path::new("/nonexistent/kubelet_internal_checkpoint");
        let ran = crate::fuzz::Fuzz::new("device-checkpoint").seed(sample(true)).seed(sample(false)).run(|input| {
            let _ = decode(path, input);
        });
        assert!(ran > 2);
    }
}
