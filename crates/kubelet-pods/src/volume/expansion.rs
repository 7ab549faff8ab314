//! Online expansion of a published volume, the node's half: after the
//! external-resizer grew the volume in its controller (the PV's
//! `spec.capacity` is the new size) and marked the claim
//! `status.allocatedResourceStatuses.storage: NodeResizePending`, the node
//! calls the driver's `NodeExpandVolume` for the volume as its pod uses it
//! and writes the claim's status, as the kubelet's node expander does:
//!
//! 1. `allocatedResourceStatuses.storage: NodeResizeInProgress` (with the
//!    claim's resourceVersion, so a claim changed meanwhile is read again),
//!    where the claim tracks its steps there (1.32 and later);
//! 2. the driver's call;
//! 3. done: `status.capacity.storage` the new size, the storage entry of
//!    `allocatedResourceStatuses` gone, and the resize conditions
//!    (`Resizing`, `FileSystemResizePending`, `ControllerResizeError`,
//!    `NodeResizeError`) removed; failed with a final error (the driver's
//!    answer, not one of the codes that say "try again"): a
//!    `NodeResizeError` condition `failed to expand pvc with <error>` beside
//!    the others, and the next round tries again. A transient failure
//!    (`Canceled`, `DeadlineExceeded`, `Unavailable`, `ResourceExhausted`,
//!    `Aborted`, no answer in time) writes nothing and is tried again.
//!
//! Recovery (`RecoverVolumeExpansionFailure`, 1.32 and later), as the
//! kubelet: a failure the driver calls infeasible (`InvalidArgument`,
//! `OutOfRange`, `NotFound`), or a final failure after an earlier final
//! failure once the user asked for another size than the one that failed,
//! marks the node's step `NodeResizeInfeasible`; the resizer may then give
//! the volume the size the user asks for now, and the node expands to that.
//! A driver that refuses to expand a volume in use (`FailedPrecondition`)
//! is not asked again while the volume stays published on the node.
//!
//! This file decides and writes the patches; `csi.rs` makes the call.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};

use kubelet_provider::quantity::parse_units;

/// The conditions an expansion owns (upstream's `knownResizeConditions`).
const RESIZE_CONDITIONS: [&str; 4] =
    ["FileSystemResizePending", "Resizing", "ControllerResizeError", "NodeResizeError"];

/// A node expansion that is due: the size the volume has now.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Due {
    /// The PV's new capacity, as the API wrote it.
    pub size: Quantity,
    /// The same, in bytes.
    pub bytes: i64,
    /// Whether the claim tracks the steps in `allocatedResourceStatuses`
    /// (1.32 and later: `RecoverVolumeExpansionFailure`). Without it the
    /// node writes only the capacity and the conditions, as the kubelet
    /// does there (NodeRestriction refuses anything else).
    pub tracked: bool,
}

/// Whether the node must expand `claim`'s volume now: the PV is larger
/// than the claim's `status.capacity` and the resizer left the node's step
/// pending (or in progress: a node that stopped in the middle goes on).
/// A resizer that does not write `allocatedResourceStatuses` (an API
/// server before 1.32, where that field is off) says so with the
/// `FileSystemResizePending` condition instead.
pub(crate) fn due(claim: &PersistentVolumeClaim, volume: &PersistentVolume) -> Option<Due> {
    let size = volume.spec.as_ref()?.capacity.as_ref()?.get("storage")?.clone();
    let bytes = parse_units(&size.0).ok()?;
    let status = claim.status.as_ref()?;
    let current = status.capacity.as_ref().and_then(|c| c.get("storage")).and_then(|q| parse_units(&q.0).ok());
    if current.is_some_and(|current| current >= bytes) {
        return None;
    }
    let step = status.allocated_resource_statuses.as_ref().and_then(|s| s.get("storage")).map(String::as_str);
    let pending_condition =
        status.conditions.iter().flatten().any(|c| c.type_ == "FileSystemResizePending" && c.status == "True");
    let pending = match step {
        Some(step) => matches!(step, "NodeResizePending" | "NodeResizeInProgress"),
        None => pending_condition,
    };
    if !pending {
        return None;
    }
    Some(Due { size, bytes: i64::try_from(bytes).ok()?, tracked: step.is_some() })
}

/// Step 1: the node's step is in progress.
pub(crate) fn in_progress(claim: &PersistentVolumeClaim) -> Value {
    json!({
        "metadata": {"resourceVersion": claim.metadata.resource_version},
        "status": {"allocatedResourceStatuses": {"storage": "NodeResizeInProgress"}},
    })
}

/// Step 3, done: the claim has the new size; nothing of the resize is left
/// (the storage entry of `allocatedResourceStatuses` only where the claim
/// tracks it, `tracked`).
pub(crate) fn finished(claim: &PersistentVolumeClaim, size: &Quantity, tracked: bool) -> Value {
    let deleted: Vec<Value> = resize_conditions(claim).map(|t| json!({"type": t, "$patch": "delete"})).collect();
    let mut status = json!({"capacity": {"storage": size.0}});
    if tracked {
        status["allocatedResourceStatuses"] = json!({"storage": null});
    }
    if !deleted.is_empty() {
        status["conditions"] = Value::Array(deleted);
    }
    json!({"metadata": {"resourceVersion": claim.metadata.resource_version}, "status": status})
}

/// Step 3, failed: a `NodeResizeError` condition with the reason; with
/// `infeasible`, the node's step `NodeResizeInfeasible` as well.
pub(crate) fn failed(error: &str, now: &str, infeasible: bool) -> Value {
    let mut patch = json!({"status": {"conditions": [{
        "type": "NodeResizeError",
        "status": "True",
        "lastTransitionTime": now,
        "message": format!("failed to expand pvc with {error}"),
    }]}});
    if infeasible {
        patch["status"]["allocatedResourceStatuses"] = json!({"storage": "NodeResizeInfeasible"});
    }
    patch
}

/// How a failed `NodeExpandVolume` is taken (the kubelet's reading of the
/// driver's gRPC code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The call may still be under way or the driver was busy: nothing is
    /// written, the next round tries again.
    Transient,
    /// The driver answered: the claim gets `NodeResizeError`.
    Final,
    /// The size cannot be had (`InvalidArgument`, `OutOfRange`,
    /// `NotFound`): `NodeResizeInfeasible` as well.
    Infeasible,
    /// The driver cannot expand a volume in use (`FailedPrecondition`):
    /// final, and not asked again while the volume is published.
    InUse,
}

impl Failure {
    /// The failure a gRPC `code` means; `None` is a failure with no answer
    /// from the driver (a call that timed out is transient).
    pub(crate) fn of(code: Option<tonic::Code>, timed_out: bool) -> Self {
        use tonic::Code;
        match code {
            _ if timed_out => Failure::Transient,
            Some(
                Code::Cancelled | Code::DeadlineExceeded | Code::Unavailable | Code::ResourceExhausted | Code::Aborted,
            ) => Failure::Transient,
            Some(Code::InvalidArgument | Code::OutOfRange | Code::NotFound) => Failure::Infeasible,
            Some(Code::FailedPrecondition) => Failure::InUse,
            _ => Failure::Final,
        }
    }
}

/// The size the claim asks for now (`spec.resources.requests.storage`), in
/// bytes.
pub(crate) fn requested_bytes(claim: &PersistentVolumeClaim) -> Option<u128> {
    let requests = claim.spec.as_ref()?.resources.as_ref()?.requests.as_ref()?;
    parse_units(&requests.get("storage")?.0).ok()
}

fn resize_conditions(claim: &PersistentVolumeClaim) -> impl Iterator<Item = &str> {
    claim
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .map(|c| c.type_.as_str())
        .filter(|t| RESIZE_CONDITIONS.contains(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(capacity: &str, step: Option<&str>) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "resourceVersion": "7"},
            "status": {
                "capacity": {"storage": capacity},
                "allocatedResourceStatuses": step.map(|s| json!({"storage": s})),
                "conditions": [{"type": "FileSystemResizePending", "status": "True"}, {"type": "Other", "status": "True"}],
            },
        }))
        .expect("claim")
    }

    fn volume(capacity: &str) -> PersistentVolume {
        serde_json::from_value(json!({"metadata": {"name": "pv"}, "spec": {"capacity": {"storage": capacity}}}))
            .expect("volume")
    }

    #[test]
    fn an_expansion_is_due_only_when_the_volume_grew_and_the_resizer_left_the_node_its_step() {
        let due = due(&claim("1Gi", Some("NodeResizePending")), &volume("2Gi")).expect("due");
        assert_eq!((due.size.0.as_str(), due.bytes, due.tracked), ("2Gi", 2 << 30, true));
        assert!(super::due(&claim("1Gi", Some("NodeResizeInProgress")), &volume("2Gi")).is_some(), "resumed");
        let legacy = super::due(&claim("1Gi", None), &volume("2Gi")).expect("the legacy resizer's condition");
        assert!(!legacy.tracked);
        let mut unmarked = claim("1Gi", None);
        unmarked.status.as_mut().expect("status").conditions = None;
        assert!(super::due(&unmarked, &volume("2Gi")).is_none(), "the controller's step is not done");
        assert!(super::due(&claim("1Gi", Some("ControllerResizeInProgress")), &volume("2Gi")).is_none());
        assert!(super::due(&claim("2Gi", Some("NodeResizePending")), &volume("2Gi")).is_none(), "already that size");
        assert!(super::due(&claim("1024Mi", Some("NodeResizePending")), &volume("1Gi")).is_none(), "units compared");
    }

    #[test]
    fn the_patches_are_the_node_expanders() {
        let claim = claim("1Gi", Some("NodeResizeInProgress"));
        assert_eq!(
            in_progress(&claim),
            json!({"metadata": {"resourceVersion": "7"}, "status": {"allocatedResourceStatuses": {"storage": "NodeResizeInProgress"}}})
        );
        assert_eq!(
            finished(&claim, &Quantity("2Gi".into()), false),
            json!({"metadata": {"resourceVersion": "7"}, "status": {
                "capacity": {"storage": "2Gi"},
                "conditions": [{"type": "FileSystemResizePending", "$patch": "delete"}],
            }}),
            "before 1.32: capacity and conditions only"
        );
        assert_eq!(
            finished(&claim, &Quantity("2Gi".into()), true),
            json!({"metadata": {"resourceVersion": "7"}, "status": {
                "capacity": {"storage": "2Gi"},
                "allocatedResourceStatuses": {"storage": null},
                "conditions": [{"type": "FileSystemResizePending", "$patch": "delete"}],
            }})
        );
        let failed = failed("rpc error: code = Internal", "2026-11-28T00:00:00Z", false);
        assert_eq!(
            failed["status"]["conditions"][0]["message"],
            "failed to expand pvc with rpc error: code = Internal"
        );
        assert!(failed["status"].get("allocatedResourceStatuses").is_none(), "a final error leaves the step");
        let infeasible = super::failed("out of range", "2026-11-28T00:00:00Z", true);
        assert_eq!(infeasible["status"]["allocatedResourceStatuses"], json!({"storage": "NodeResizeInfeasible"}));
        assert_eq!(infeasible["status"]["conditions"][0]["type"], "NodeResizeError");
    }

    #[test]
    fn failures_are_read_from_the_drivers_code_as_the_kubelet_reads_them() {
        use tonic::Code;
        for code in [Code::Cancelled, Code::DeadlineExceeded, Code::Unavailable, Code::ResourceExhausted, Code::Aborted]
        {
            assert_eq!(Failure::of(Some(code), false), Failure::Transient, "{code:?}");
        }
        for code in [Code::InvalidArgument, Code::OutOfRange, Code::NotFound] {
            assert_eq!(Failure::of(Some(code), false), Failure::Infeasible, "{code:?}");
        }
        assert_eq!(Failure::of(Some(Code::FailedPrecondition), false), Failure::InUse);
        assert_eq!(Failure::of(Some(Code::PermissionDenied), false), Failure::Final);
        assert_eq!(Failure::of(Some(Code::Internal), false), Failure::Final);
        assert_eq!(Failure::of(None, false), Failure::Final, "no gRPC answer: the operation is over");
        assert_eq!(Failure::of(None, true), Failure::Transient, "no answer in time: it may still be running");
    }

    #[test]
    fn the_size_asked_for_is_the_claims_request() {
        let claim: PersistentVolumeClaim =
            serde_json::from_value(json!({"spec": {"resources": {"requests": {"storage": "5Gi"}}}})).expect("claim");
        assert_eq!(requested_bytes(&claim), Some(5 << 30));
        assert_eq!(requested_bytes(&PersistentVolumeClaim::default()), None);
    }
}
